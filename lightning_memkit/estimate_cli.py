"""``memkit estimate``: the predicted device memory of a training step, from an HF ``config.json`` or a memkit config.

Nothing is downloaded and no weight is allocated: the model is built from its configuration under fake
tensors by :func:`~lightning_memkit.memory.estimate_training_memory`, which runs two real training steps on
them and reports the second (optimizer state already allocated) per phase.

    memkit estimate --hf-config examples/hf_configs/gpt_oss_20b.json --seq-len 4096 --batch-size 1 \\
        --precision bf16-true --activation-checkpointing --fused-loss --optimizer adamw [--json]
    memkit estimate --hf-config ... --pipeline 2 [--microbatches 4]   # per-rank peaks under memkit_pipeline
    memkit estimate --config examples/configs/tiny_lm.yaml [--json] [--model.n_layers 2 ...]

Example (a tiny Llama config written to a file; the shipped ones are in ``examples/hf_configs/``)::

    >>> import pathlib, tempfile
    >>> from lightning_memkit.demo.hf_models import tiny_hf_config
    >>> from lightning_memkit.estimate_cli import estimate_from_hf_config
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "config.json"
    >>> _ = path.write_text(tiny_hf_config("llama", vocab_size=1000).to_json_string())
    >>> est = estimate_from_hf_config(path, seq_len=16, precision="bf16-true", optimizer="sgd")
    >>> est.parameters, est.phases[0].weights - 2 * est.parameters   # bf16 weights; the rest: rotary buffer
    (202048, 80)
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_memkit.estimate_inputs import (
    InputWarning,
    check_pipeline,
    check_pipeline_family,
    check_positions,
    check_tokens,
    checked,
    read_hf_config,
)
from lightning_memkit.memory.estimate import (
    CHECKPOINT_MODES,
    OPTIMIZERS,
    PRECISIONS,
    TARGETS,
    MemoryEstimate,
    estimate_training_memory,
)
from lightning_memkit.validation import check_int, check_number

__all__ = ["PipelineEstimate", "estimate_from_hf_config", "estimate_from_config", "estimate_hf_pipeline", "main"]

DEFAULT_LORA_RANK = 16
PLUGINS = tuple(f"{mode}-lora" for mode in ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8"))


def estimate_from_hf_config(path: str | Path, seq_len: int = 2048, batch_size: int = 1, precision: str = "32-true",
                            optimizer: str = "adamw", activation_checkpointing: bool | str = False,
                            fused_loss: bool = False, plugin: str | None = None,
                            lora_rank: int = DEFAULT_LORA_RANK, accumulate: bool = False,
                            device: str = "cuda") -> MemoryEstimate:
    """Estimate one training step of the causal LM described by the HF ``config.json`` at ``path``.

    The batch is ``input_ids`` and ``labels`` of ``(batch_size, seq_len)``; the loss is the model's own
    (``model(**batch).loss``), or :func:`~lightning_memkit.hf.fused_linear_cross_entropy` with ``fused_loss``;
    ``activation_checkpointing`` (``True``/``"full"`` or ``"selective"``) recomputes every decoder layer with
    the KV cache off, as :class:`~lightning_memkit.callbacks.ActivationCheckpointing` does; ``plugin``
    (``"nf4-lora"``, ...: :data:`PLUGINS`) quantizes the model with
    :class:`~lightning_memkit.plugins.NoSaveBitsandbytesPrecision` in ``precision``'s dtype with LoRA adapters
    of ``lora_rank``. A ``quantization_config`` in the file is ignored: the weights are dense in the training
    dtype unless ``plugin`` quantizes them. ``accumulate``: the batch is one micro-batch of several
    (``accumulate_grad_batches > 1``): the gradients stay alive through the step. ``device``: ``"cuda"`` adds
    the CUDA-only terms (``estimate_training_memory``'s ``target``), ``"cpu"`` counts the step as it runs here.
    The token batch is fake (no memory). Every input is checked before any work
    (:mod:`lightning_memkit.estimate_inputs`): a bad one raises ``ConfigError`` (a ``ValueError``) naming it;
    sizes left to the config class's defaults and unknown keys warn (``InputWarning``).
    """
    check_choices(precision=precision, optimizer=optimizer, device=device)
    mode = checkpoint_mode(activation_checkpointing)
    qlora = qlora_plugin(plugin, precision, lora_rank)
    model, batch, _ = _hf_factories(Path(path), seq_len, batch_size)
    return estimate_training_memory(model, batch, optimizer=optimizer, precision="32-true" if qlora else precision,
                                    checkpoint="auto" if mode else None, checkpoint_mode=mode or "full",
                                    patches=_hf_patches(bool(mode), fused_loss), plugin=qlora,
                                    zero_grad="accumulate" if accumulate else "after_forward", target=device,
                                    fake_batch=True)


def checkpoint_mode(activation_checkpointing: bool | str | None) -> str | None:
    """``"full"``, ``"selective"`` or ``None`` (off) from ``True``/``False``/a mode name."""
    from lightning_memkit.cli import ConfigError

    if activation_checkpointing in (None, False):
        return None
    if activation_checkpointing is True:
        return "full"
    if activation_checkpointing not in CHECKPOINT_MODES:
        raise ConfigError(f"--activation-checkpointing: {activation_checkpointing!r} is not a mode; allowed: "
                          f"{', '.join(CHECKPOINT_MODES)}")
    return activation_checkpointing


def plugin_dtype(precision: str) -> torch.dtype:
    """The compute dtype a ``--plugin`` gets from ``--precision``: bfloat16 (``bf16-*``), float16, else float32."""
    return {"bf16-true": torch.bfloat16, "bf16-mixed": torch.bfloat16, "16-true": torch.float16}.get(
        precision, torch.float32)


def qlora_plugin(name: str | None, precision: str, lora_rank: int = DEFAULT_LORA_RANK) -> Any:
    """The :class:`~lightning_memkit.plugins.NoSaveBitsandbytesPrecision` that ``--plugin name`` stands for:
    ``name`` without ``-lora`` as its mode, ``precision``'s dtype, LoRA adapters of ``lora_rank``."""
    from lightning_memkit.cli import ConfigError

    if name is None:
        return None
    if name not in PLUGINS:
        raise ConfigError(f"--plugin: {name!r} is not estimated; allowed: {', '.join(PLUGINS)} (quantized layers "
                          "are frozen: without LoRA adapters nothing would train)")
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1:
        raise ConfigError(f"--lora-rank: must be an int >= 1, got {lora_rank!r}")
    from lightning_memkit.plugins import NoSaveBitsandbytesPrecision

    try:
        return NoSaveBitsandbytesPrecision(name.removesuffix("-lora"), plugin_dtype(precision), lora_rank=lora_rank)
    except ValueError as err:
        raise ConfigError(f"--plugin {name} with --precision {precision}: {err}") from err


def _hf_factories(path: Path, seq_len: int, batch_size: int, sequences: int | None = None) -> tuple[Any, Any, Any]:
    """``(model_factory, batch_factory)`` of the causal LM in ``path``: random ``input_ids`` and ``labels`` of
    ``sequences`` (default ``batch_size``) rows, made under the estimate's fake mode (no memory). Every input is
    checked first (:mod:`lightning_memkit.estimate_inputs`); returns the config too."""
    seq_len, batch_size = check_tokens(seq_len, batch_size)
    config = read_hf_config(path)
    check_positions(seq_len, config, path)
    vocab, rows = config.vocab_size, sequences or batch_size

    def model() -> torch.nn.Module:
        import transformers

        return transformers.AutoModelForCausalLM.from_config(config)

    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (rows, seq_len))
        return {"input_ids": ids, "labels": torch.randint(0, vocab, (rows, seq_len))}

    return model, batch, config


@dataclass
class PipelineEstimate:
    """Per-rank peaks of an HF causal LM split into pipeline stages, as ``memkit_pipeline`` would split it."""

    partition: Any  # lightning_memkit.pipeline.Partition
    parameters: int
    seconds: float

    @property
    def peak_bytes(self) -> int:
        return self.partition.max_peak_bytes

    def to_json(self) -> str:
        p = self.partition
        return json.dumps({"peak_bytes": self.peak_bytes, "parameters": self.parameters, "schedule": p.schedule,
                           "microbatches": p.microbatches, "stage_sizes": list(p.sizes),
                           "rank_peak_bytes": list(p.predicted_peak_bytes), "seconds": self.seconds}, indent=2)

    def notes(self) -> str:
        from lightning_memkit.memory.storage import format_bytes

        p = self.partition
        ranks = ", ".join(f"rank {r}: {format_bytes(b)}" for r, b in enumerate(p.predicted_peak_bytes))
        return (f"memkit estimate: {self.parameters:,} parameters in {p.num_stages} pipeline stages "
                f"(layers per stage {list(p.sizes)}), {p.schedule}, {p.microbatches} microbatches\n"
                f"per-rank peak: {ranks}\nsteady-state step peak: {format_bytes(self.peak_bytes)} "
                f"({self.peak_bytes:,} B) on the busiest rank\n"
                "from memkit_pipeline's cost model: each layer's bytes measured on fake tensors, then the split "
                "with the smallest largest rank peak (partition='memory')\n"
                f"estimated in {self.seconds:.1f} s")


def estimate_hf_pipeline(path: str | Path, stages: int, microbatches: int | None = None, seq_len: int = 2048,
                         batch_size: int = 1, precision: str = "32-true", optimizer: str = "adamw",
                         activation_checkpointing: bool | str = False, fused_loss: bool = False) -> PipelineEstimate:
    """Per-rank peaks of the causal LM of ``path`` under ``memkit_pipeline`` (``stages`` ranks, 1F1B).

    The strategy's own planning on fake tensors: :func:`~lightning_memkit.hf.pipeline_stages.causal_lm_stages`
    cuts the model, :func:`~lightning_memkit.pipeline.runtime.measure_pipeline_costs` measures each layer on one
    microbatch (``batch_size / microbatches`` sequences; ``microbatches`` defaults to ``stages``) and
    :func:`~lightning_memkit.pipeline.partition_layers` picks the split and predicts each rank's peak.
    A bad input (a family the pipeline does not split included) raises ``ConfigError`` before any work.
    """
    import time

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from lightning_memkit.hf.pipeline_stages import causal_lm_stages
    from lightning_memkit.memory.estimate import build_model, default_dtype, precision_dtype, resolve_optimizer
    from lightning_memkit.memory.estimate_trace import fake_tensors
    from lightning_memkit.pipeline import partition_layers
    from lightning_memkit.pipeline.runtime import measure_pipeline_costs

    model, batch, microbatches, mode = _pipeline_inputs(path, stages, microbatches, seq_len, batch_size, precision,
                                                        optimizer, activation_checkpointing)
    start = time.perf_counter()
    with fake_tensors(), contextlib.ExitStack() as stack:
        net = build_model(model, precision)
        for patch in _hf_patches(bool(mode), False):
            stack.enter_context(patch(net))
        if mode:
            from lightning_memkit.memory import checkpoint_modules, repeated_blocks

            stack.enter_context(checkpoint_modules(repeated_blocks(net), mode=mode))
        tokens = batch()  # fake input_ids and labels: no memory for them
        with unset_fake_temporarily():  # the split wraps the fake modules; its self-checks run on real numbers
            split = causal_lm_stages(net, fused_loss=fused_loss)
            # the padding mask HF reads (all ones: the causal mask is skipped as in a real run): real, one microbatch
            mask = torch.ones(tokens["input_ids"].shape, dtype=torch.int64)
        inputs, target = split.inputs({**tokens, "attention_mask": mask})
        opt = resolve_optimizer(optimizer, None)[0](net)
        with torch.random.fork_rng(), default_dtype(precision_dtype(precision)):
            costs = measure_pipeline_costs(list(split.layers), inputs, target, loss_fn=split.loss, optimizer=opt)
        parameters = sum(p.numel() for p in net.parameters())
    partition = partition_layers(costs, stages, schedule="1f1b", microbatches=microbatches)
    return PipelineEstimate(partition, parameters, time.perf_counter() - start)


def _pipeline_inputs(path: str | Path, stages: int, microbatches: int | None, seq_len: int, batch_size: int,
                     precision: str, optimizer: str, activation_checkpointing: bool | str) -> tuple[Any, ...]:
    """``(model_factory, batch_factory, microbatches, checkpoint mode)`` of :func:`estimate_hf_pipeline`, every
    input checked (the family among those ``memkit_pipeline`` splits)."""
    seq_len, batch_size = check_tokens(seq_len, batch_size)
    microbatches = check_pipeline(stages, microbatches, batch_size)
    check_choices(precision=precision, optimizer=optimizer)
    mode = checkpoint_mode(activation_checkpointing)
    model, batch, config = _hf_factories(Path(path), seq_len, batch_size, sequences=batch_size // microbatches)
    check_pipeline_family(config, path)
    return model, batch, microbatches, mode


def _hf_patches(activation_checkpointing: bool, fused_loss: bool) -> list[Any]:
    """The KV cache off under checkpointing (as ``ActivationCheckpointing`` does), the fused loss if asked."""
    from lightning_memkit.hf.layers import kv_cache_off

    patches = [kv_cache_off] if activation_checkpointing else []
    return patches + ([fused_linear_cross_entropy_inside] if fused_loss else [])


@contextlib.contextmanager
def fused_linear_cross_entropy_inside(module: torch.nn.Module) -> Any:
    """:func:`~lightning_memkit.hf.fused_linear_cross_entropy` on the causal LMs the ``FusedLinearCrossEntropy``
    callback would patch in ``module`` (its ``find_causal_lms``: itself, or those a LightningModule holds)."""
    from lightning_memkit.callbacks.fused_linear_cross_entropy import find_causal_lms
    from lightning_memkit.cli import ConfigError
    from lightning_memkit.hf import fused_linear_cross_entropy

    try:
        models = find_causal_lms(module)
    except ValueError as err:
        raise ConfigError(f"fused loss (FusedLinearCrossEntropy, --fused-loss): {err}") from err
    with contextlib.ExitStack() as stack:
        for model in models:
            stack.enter_context(fused_linear_cross_entropy(model))
        yield


# -- a memkit / LightningCLI config ---------------------------------------------------------------------------
def _class_name(entry: Any) -> str:
    path = entry.get("class_path", "") if isinstance(entry, dict) else str(entry or "")
    return path.rpartition(".")[2]


def _config_features(trainer: dict[str, Any]) -> dict[str, Any]:
    """Checkpointing, fused loss, precision, QLoRA plugin and accumulation from a parsed config's trainer."""
    from lightning_memkit.cli import ConfigError

    plugin = _config_plugin(trainer)
    precision = str(trainer.get("precision") or "32-true")
    if precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision: {precision!r} is not estimated; allowed: {', '.join(PRECISIONS)}")
    if plugin is not None and trainer.get("precision") not in (None, "32-true", "32"):
        raise ConfigError("trainer.precision and trainer.plugins: a precision plugin sets the precision itself "
                          f"(Trainer refuses both); remove precision={precision!r}")
    callbacks = trainer.get("callbacks") or []
    return {**_config_checkpoint(callbacks), "precision": precision, "plugin": plugin,
            "fused": any(_class_name(c) == "FusedLinearCrossEntropy" for c in callbacks),
            "accumulate": int(trainer.get("accumulate_grad_batches") or 1) > 1}


def _config_plugin(trainer: dict[str, Any]) -> Any:
    """The config's ``NoSaveBitsandbytesPrecision`` (built), or None; anything else estimate cannot run refused."""
    from lightning_memkit.cli import ConfigError

    plugins = trainer.get("plugins") or []
    plugins = [plugins] if isinstance(plugins, (dict, str)) else list(plugins)
    others = [_class_name(p) for p in plugins if _class_name(p) != "NoSaveBitsandbytesPrecision"]
    strategy = trainer.get("strategy")
    if others or _class_name(strategy) == "MemkitPipelineStrategy" or strategy == "memkit_pipeline":
        raise ConfigError(f"trainer: memkit estimate does not estimate {', '.join(others) or 'the pipeline strategy'} "
                          "from a config; remove it to estimate the plain step (use --hf-config with --pipeline N "
                          "for pipeline stages)")
    return _instantiate(plugins[0]) if plugins else None


def _config_checkpoint(callbacks: list[Any]) -> dict[str, Any]:
    """``{"checkpoint": None | "full" | "selective", "policy": ...}`` from an ``ActivationCheckpointing`` entry."""
    ac = next((c for c in callbacks if _class_name(c) == "ActivationCheckpointing"), None)
    args = (ac.get("init_args") or {}) if isinstance(ac, dict) else {}
    mode = None if ac is None else ("selective" if args.get("selective") else "full")
    return {"checkpoint": mode, "policy": args.get("policy") or "auto"}


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
            self.datamodule = _instantiate(self.entry)
            self.datamodule.prepare_data()
            self.datamodule.setup("fit")
            self.batches = iter(self.datamodule.train_dataloader())

    def __call__(self) -> Any:
        if self.batches is None:
            self.start()
        return next(self.batches)


def _step_loss(module: Any, batch: Any) -> torch.Tensor:
    out = module.training_step(batch, 0)
    return out["loss"] if isinstance(out, dict) else out


def estimate_from_config(config: str | Path, overrides: Sequence[str] = ()) -> MemoryEstimate:
    """Estimate one training step of a memkit/LightningCLI config: its model (``class_path``), the first batch
    of its data module, its ``configure_optimizers``, precision, ``ActivationCheckpointing`` (full or selective),
    ``FusedLinearCrossEntropy`` and a ``NoSaveBitsandbytesPrecision`` plugin (QLoRA)."""
    from lightning_memkit.cli import ConfigError
    from lightning_memkit.compare import parse_config

    config = Path(config)
    if not config.is_file():
        raise ConfigError(f"--config: no such file: {config}")
    return estimate_parsed_config(parse_config(config, [str(a) for a in overrides]))


def estimate_parsed_config(parsed: dict[str, Any]) -> MemoryEstimate:
    """:func:`estimate_from_config` of a config already parsed (``lightning_memkit.compare.parse_config``)."""

    trainer = parsed.get("trainer") or {}
    features = _config_features(trainer)
    batches = _Batches(parsed["data"])
    if trainer.get("accelerator") not in ("cpu", None):  # the dataset stays in host memory: not counted
        batches.start()
    mode = features["checkpoint"]
    patches = _hf_patches(mode is not None, features["fused"])
    model_entry = parsed["model"]
    return estimate_training_memory(lambda: _instantiate(model_entry), batches, loss_fn=_step_loss,
                                    optimizer=_configured_optimizer, precision=features["precision"],
                                    checkpoint=features["policy"] if mode else None, checkpoint_mode=mode or "full",
                                    patches=patches, plugin=features["plugin"],
                                    zero_grad="accumulate" if features["accumulate"] else "after_forward",
                                    target="cpu" if trainer.get("accelerator") == "cpu" else "cuda")


def _instantiate(entry: dict[str, Any]) -> Any:
    import importlib

    module, _, name = entry["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**(entry.get("init_args") or {}))


def _configured_optimizer(model: Any) -> torch.optim.Optimizer:
    out = model.configure_optimizers()
    if isinstance(out, dict):
        out = out["optimizer"]
    if isinstance(out, (list, tuple)):
        out = out[0][0] if isinstance(out[0], (list, tuple)) else out[0]
    return out


# -- command line ------------------------------------------------------------------------------------------
_HF_DEFAULTS = {"seq_len": 2048, "batch_size": 1, "precision": "32-true", "optimizer": "adamw",
                "activation_checkpointing": False, "fused_loss": False, "plugin": None,
                "lora_rank": DEFAULT_LORA_RANK, "device": "cuda"}


def _integer(text: str) -> int | str:
    """``argparse`` type of the integer options: digits as an int, anything else (``1e10``) as given, for the
    option's own check to refuse in one line naming it and what it allows."""
    try:
        return int(text)
    except ValueError:
        return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="memkit estimate", exit_on_error=False, allow_abbrev=False,
        description="Predict the device memory of a training step (steady state: optimizer state allocated) "
        "without allocating it: the model runs on fake tensors. Give --hf-config or --config; the options "
        "after --hf-config describe the run (a --config says them itself; override its keys as in memkit fit).",
    )
    p.add_argument("-c", "--config", default=None, help="a memkit / LightningCLI YAML config")
    p.add_argument("--hf-config", default=None, help="a Hugging Face config.json of a causal LM")
    p.add_argument("--seq-len", type=_integer, default=None, help="tokens per sequence (default 2048)")
    p.add_argument("--batch-size", type=_integer, default=None, help="sequences per batch (default 1)")
    p.add_argument("--precision", default=None, help=f"one of {', '.join(PRECISIONS)} (default 32-true)")
    p.add_argument("--optimizer", default=None, help="adamw (default) or sgd (momentum 0.9)")
    p.add_argument("--activation-checkpointing", nargs="?", const="full", default=None,
                   help="recompute every decoder layer: full (the default when given) or selective (keep matmul "
                   "and attention outputs)")
    p.add_argument("--fused-loss", action="store_true", default=None,
                   help="fused linear cross-entropy: no (B, T, V) logits")
    p.add_argument("--plugin", default=None, help=f"quantized model with LoRA adapters (QLoRA, "
                   f"NoSaveBitsandbytesPrecision in --precision's dtype): one of {', '.join(PLUGINS)}")
    p.add_argument("--lora-rank", type=_integer, default=None,
                   help=f"LoRA rank with --plugin (default {DEFAULT_LORA_RANK})")
    p.add_argument("--device", default=None, help="where the step will run: cuda (default: adds optimizer.step()'s "
                   "foreach temporaries; kernel workspaces and allocator rounding are not counted) or cpu")
    p.add_argument("--budget", default=None, help="device memory available, e.g. 24GiB or 80GB: search the "
                   "feature plans that fit and print the cheapest as LightningCLI YAML fragments")
    p.add_argument("--margin", type=float, default=None,
                   help="with --budget: a plan fits when its peak plus this fraction is within the budget "
                   "(default 0.05, the estimate's accuracy goal)")
    p.add_argument("--max-plans", type=_integer, default=None, help="with --budget: plans to print (default 3)")
    p.add_argument("--max-estimates", type=_integer, default=None,
                   help="with --budget: stop after this many estimates (default 48; each takes one estimate's time)")
    p.add_argument("--pipeline", type=_integer, default=None,
                   help="ranks of a memkit_pipeline (1F1B): per-rank peaks of the split it would choose")
    p.add_argument("--microbatches", type=_integer, default=None,
                   help="microbatches per step with --pipeline (default 4, the strategy's; divides --batch-size)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON instead of the table")
    return p


def _check(args: argparse.Namespace) -> None:
    """Refuse contradictory or unsupported options; fill the --hf-config defaults."""
    from lightning_memkit.cli import ConfigError

    if (args.config is None) == (args.hf_config is None):
        raise ConfigError("give exactly one of --config path/to/config.yaml or --hf-config path/to/config.json")
    given = [f"--{k.replace('_', '-')}" for k in _HF_DEFAULTS if getattr(args, k) is not None]
    if args.config is not None and given:
        raise ConfigError(f"{', '.join(given)}: with --config the config says these; override its keys instead "
                          "(--trainer.precision bf16-true, --data.init_args.seq_len 512, ...)")
    for key, default in _HF_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    check_choices(precision=args.precision, device=args.device, optimizer=args.optimizer)
    check_tokens(args.seq_len, args.batch_size)
    if args.plugin is not None:
        qlora_plugin(args.plugin, args.precision, args.lora_rank)  # raises naming what is allowed
    elif args.config is None and args.lora_rank != DEFAULT_LORA_RANK:
        raise ConfigError("--lora-rank: only with --plugin")
    checkpoint_mode(args.activation_checkpointing)
    _check_budget(args)
    _check_pipeline(args)


def check_choices(**values: Any) -> None:
    """``precision=``, ``optimizer=``, ``device=``: each one that ``memkit estimate`` estimates, or ``ConfigError``."""
    from lightning_memkit.cli import ConfigError

    allowed = {"precision": PRECISIONS, "optimizer": OPTIMIZERS, "device": TARGETS}
    for key, value in values.items():
        if value not in allowed[key]:
            raise ConfigError(f"--{key}: {value!r} is not supported; allowed: {', '.join(allowed[key])}")


def _check_budget(args: argparse.Namespace) -> None:
    from lightning_memkit.cli import ConfigError
    from lightning_memkit.estimate_plans import parse_bytes

    if args.budget is None:
        for key in ("margin", "max_plans", "max_estimates"):
            if getattr(args, key) is not None:
                raise ConfigError(f"--{key.replace('_', '-')}: only with --budget")
        return
    if args.pipeline is not None:
        raise ConfigError("--budget and --pipeline: the budget search tries pipeline stages itself; leave out "
                          "--pipeline")
    args.budget = parse_bytes(args.budget)
    args.margin = checked(check_number, 0.05 if args.margin is None else args.margin, "--margin", minimum=0,
                          maximum=1, max_inclusive=False)
    args.max_plans = checked(check_int, 3 if args.max_plans is None else args.max_plans, "--max-plans", minimum=1)
    # at least the run as given and the strongest plan
    args.max_estimates = checked(check_int, 48 if args.max_estimates is None else args.max_estimates,
                                 "--max-estimates", minimum=2)


def _check_pipeline(args: argparse.Namespace) -> None:
    from lightning_memkit.cli import ConfigError

    if args.pipeline is None:
        if args.microbatches is not None:
            raise ConfigError("--microbatches: only with --pipeline N")
        return
    if args.config is not None:
        raise ConfigError("--pipeline: only with --hf-config (a --config sets its strategy itself)")
    if args.plugin is not None:
        raise ConfigError("--pipeline with --plugin: quantized pipeline stages are not estimated; leave one out")
    args.microbatches = check_pipeline(args.pipeline, 4 if args.microbatches is None else args.microbatches,
                                       args.batch_size)


def main(argv: Sequence[str] | None = None) -> Any:
    """``memkit estimate ...``: print the table (or ``--json``); bad arguments raise ``ConfigError``.

    Returns the :class:`~lightning_memkit.memory.MemoryEstimate`, :class:`PipelineEstimate` or, with
    ``--budget``, :class:`~lightning_memkit.estimate_plans.SearchResult`.
    """
    from lightning_memkit.cli import ConfigError, parse_subcommand, report_console

    args, overrides = parse_subcommand(_parser(), argv)
    _check(args)
    if args.hf_config is not None and overrides:
        raise ConfigError(f"unrecognized arguments: {' '.join(overrides)}")
    with _input_warnings_on_stderr():
        if args.budget is not None:
            return _search(args, overrides)
        est = _estimate(args, overrides)
    if args.json:
        print(est.to_json())
        return est
    console = report_console()
    if isinstance(est, MemoryEstimate):
        console.print(est.table())
    console.print(est.notes(), markup=False, highlight=False, soft_wrap=True)
    return est


def _estimate(args: argparse.Namespace, overrides: Sequence[str]) -> Any:
    """The estimate the checked ``args`` ask for: of an HF config (pipeline stages or one device) or a config."""
    if args.config is not None:
        return estimate_from_config(args.config, overrides)
    run = (dict(stages=args.pipeline, microbatches=args.microbatches) if args.pipeline else
           dict(plugin=args.plugin, lora_rank=args.lora_rank, device=args.device))
    fn = estimate_hf_pipeline if args.pipeline else estimate_from_hf_config
    return fn(args.hf_config, seq_len=args.seq_len, batch_size=args.batch_size, precision=args.precision,
              optimizer=args.optimizer, activation_checkpointing=args.activation_checkpointing,
              fused_loss=args.fused_loss, **run)


@contextlib.contextmanager
def _input_warnings_on_stderr() -> Iterator[None]:
    """Each :class:`~lightning_memkit.estimate_inputs.InputWarning` once, as a ``memkit estimate: ...`` line on
    stderr (as the ``--budget`` progress lines); other warnings as Python shows them."""
    import sys
    import warnings

    shown, printed = warnings.showwarning, set()

    def show(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if not issubclass(category, InputWarning):
            shown(message, category, filename, lineno, file, line)
        elif str(message) not in printed:  # once, though a --budget search reads the config for each estimate
            printed.add(str(message))
            print(f"memkit estimate: {message}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.simplefilter("always", InputWarning)
        warnings.showwarning = show
        yield


def _search(args: argparse.Namespace, overrides: Sequence[str]) -> Any:
    """``--budget``: the plan search, with a line per estimate on stderr."""
    import sys

    from lightning_memkit.estimate_plans import ConfigRun, HFRun, search_plans

    if args.hf_config is not None:
        run = HFRun(args.hf_config, seq_len=args.seq_len, batch_size=args.batch_size, precision=args.precision,
                    optimizer=args.optimizer, activation_checkpointing=args.activation_checkpointing,
                    fused_loss=args.fused_loss, plugin=args.plugin, lora_rank=args.lora_rank, device=args.device)
    else:
        run = ConfigRun(args.config, list(overrides))
    result = search_plans(run, args.budget, margin=args.margin, max_plans=args.max_plans,
                          max_estimates=args.max_estimates,
                          progress=lambda line: print(f"memkit estimate: {line}", file=sys.stderr, flush=True))
    print(result.to_json() if args.json else result)
    return result
