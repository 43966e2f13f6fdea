"""The estimate of a memkit / LightningCLI config: its model, data, optimizer, precision and memkit features.

Example (from a checkout)::

    >>> from lightning_memkit.estimate.config import estimate_from_config
    >>> est = estimate_from_config("examples/configs/tiny_lm.yaml", ["--model.n_layers", "1"])
    >>> est.peak_bytes > est.parameters > 0
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_memkit.common.class_paths import class_name
from lightning_memkit.common.errors import ConfigError
from lightning_memkit.config.lightning_cli import instantiate, parse_config
from lightning_memkit.estimate.step import (
    PRECISIONS,
    MemoryEstimate,
    configured_optimizer,
    estimate_training_memory,
    step_loss,
)
from lightning_memkit.estimate.step_spec import StepSpec, World

__all__ = ["config_devices", "config_features", "config_plan", "config_step", "estimate_from_config",
           "estimate_parsed_config"]


def config_features(trainer: dict[str, Any]) -> dict[str, Any]:
    """Checkpointing, fused loss, precision, QLoRA plugin and accumulation from a parsed config's trainer."""

    plugin = _config_plugin(trainer)
    precision = str(trainer.get("precision") or "32-true")
    if precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision: {precision!r} is not estimated; allowed: {', '.join(PRECISIONS)}")
    if plugin is not None and trainer.get("precision") not in (None, "32-true", "32"):
        raise ConfigError("trainer.precision and trainer.plugins: a precision plugin sets the precision itself "
                          f"(Trainer refuses both); remove precision={precision!r}")
    callbacks = trainer.get("callbacks") or []
    return {**_config_checkpoint(callbacks), "precision": precision, "plugin": plugin,
            "fused": any(class_name(c) == "FusedLinearCrossEntropy" for c in callbacks),
            "accumulate": int(trainer.get("accumulate_grad_batches") or 1) > 1}


def _config_plugin(trainer: dict[str, Any]) -> Any:
    """The config's ``NoSaveBitsandbytesPrecision`` (built), or None; anything else estimate cannot run refused."""

    plugins = trainer.get("plugins") or []
    plugins = [plugins] if isinstance(plugins, (dict, str)) else list(plugins)
    others = [class_name(p) for p in plugins if class_name(p) != "NoSaveBitsandbytesPrecision"]
    strategy = trainer.get("strategy")
    if others or class_name(strategy) == "MemkitPipelineStrategy" or strategy == "memkit_pipeline":
        raise ConfigError(f"trainer: memkit estimate does not estimate {', '.join(others) or 'the pipeline strategy'} "
                          "from a config; remove it to estimate the plain step (use --hf-config with --pipeline N "
                          "for pipeline stages)")
    return instantiate(plugins[0]) if plugins else None


def _config_checkpoint(callbacks: list[Any]) -> dict[str, Any]:
    """``{"checkpoint": None | "full" | "selective", "policy": ...}`` from an ``ActivationCheckpointing`` entry."""
    ac = next((c for c in callbacks if class_name(c) == "ActivationCheckpointing"), None)
    args = (ac.get("init_args") or {}) if isinstance(ac, dict) else {}
    mode = None if ac is None else ("selective" if args.get("selective") else "full")
    return {"checkpoint": mode, "policy": args.get("policy") or "auto"}


def config_plan(parsed: dict[str, Any], features: dict[str, Any] | None = None) -> Any:
    """The plan a parsed config runs, lever by lever: what :func:`config_features` reads, the data module's batch
    size as the micro-batch, and each lever that reads its own setting (``read_config``: the optimizer-state
    callbacks, the activation offload)."""
    from lightning_memkit.estimate.levers import LEVERS, Plan

    trainer = parsed.get("trainer") or {}
    features = features or config_features(trainer)
    plugin = features["plugin"]
    batch_size = int(((parsed.get("data") or {}).get("init_args") or {}).get("batch_size") or 0)
    plan = Plan(precision=features["precision"], quantization=None if plugin is None else f"{plugin.mode}-lora",
                recompute=features["checkpoint"], fused_loss=features["fused"], micro_batch=batch_size)
    return plan.replace(**{x.name: choice for x in LEVERS if (choice := x.read_config(trainer)) is not None})


def config_devices(trainer: dict[str, Any]) -> int:
    """The devices a config's trainer trains on: its ``devices`` where an int (``"auto"``, a list: 1)."""
    devices = trainer.get("devices")
    return devices if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0 else 1


def config_step(parsed: dict[str, Any]) -> StepSpec:
    """The fake step of a parsed config: its plugin (as built from the config), the blocks its
    ``ActivationCheckpointing`` recomputes, its accumulation and device, then each lever's choice of its plan
    (:func:`config_plan`) entered as for any plan."""
    from lightning_memkit.estimate.levers import LEVERS

    trainer = parsed.get("trainer") or {}
    features = config_features(trainer)
    plugin = features["plugin"]
    plan = config_plan(parsed, features)
    step = StepSpec(plugin=None if plugin is None else (lambda: plugin), policy=features["policy"],
                    world=World(replicate=config_devices(trainer)),
                    rows=plan["micro_batch"], zero_grad="accumulate" if features["accumulate"] else "after_forward",
                    target="cpu" if trainer.get("accelerator") == "cpu" else "cuda")
    for x in LEVERS:
        x.to_step(plan[x.name], step)
    return step


class _Batches:
    """The config's training batches, one per call, from its data module, made at the first call unless
    :meth:`start` made it before. Made inside the estimate (a CPU run), the data module's tensors count as
    device memory, as they do on a CPU device."""

    def __init__(self, entry: dict[str, Any]):
        self.entry, self.datamodule, self.batches = entry, None, None

    def start(self) -> None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.datamodule = instantiate(self.entry)
            self.datamodule.prepare_data()
            self.datamodule.setup("fit")
        limit = getattr(self.datamodule, "auto_length_limit", lambda: None)()
        if limit is not None:
            raise ConfigError("--config: the data module's max_length is 'auto', which MemoryBudget chooses in "
                              f"memkit fit; estimate one length with --data.init_args.max_length N (the data allows "
                              f"up to {limit:,})")
        self.batches = iter(self.datamodule.train_dataloader())

    def __call__(self) -> Any:
        if self.batches is None:
            self.start()
        return next(self.batches)


def estimate_from_config(config: str | Path, overrides: Sequence[str] = ()) -> MemoryEstimate:
    """Estimate one training step of a memkit/LightningCLI config: its model (``class_path``), the first batch
    of its data module, its ``configure_optimizers``, precision, ``ActivationCheckpointing`` (full or selective),
    ``FusedLinearCrossEntropy`` and a ``NoSaveBitsandbytesPrecision`` plugin (QLoRA)."""

    config = Path(config)
    if not config.is_file():
        raise ConfigError(f"--config: no such file: {config}")
    return estimate_parsed_config(parse_config(config, [str(a) for a in overrides]))


def estimate_parsed_config(parsed: dict[str, Any]) -> MemoryEstimate:
    """:func:`estimate_from_config` of a config already parsed (:func:`~lightning_memkit.config.parse_config`)."""

    trainer = parsed.get("trainer") or {}
    step = config_step(parsed)
    batches = _Batches(parsed["data"])
    if trainer.get("accelerator") not in ("cpu", None):  # the dataset stays in host memory: not counted
        batches.start()
    model_entry = parsed["model"]
    return estimate_training_memory(lambda: instantiate(model_entry), batches, loss_fn=step_loss,
                                    optimizer=configured_optimizer, step=step)
