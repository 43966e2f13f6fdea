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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_memkit.memory.estimate import OPTIMIZERS, PRECISIONS, MemoryEstimate, estimate_training_memory
from lightning_memkit.validation import check_int

__all__ = ["PipelineEstimate", "estimate_from_hf_config", "estimate_from_config", "estimate_hf_pipeline", "main"]

_IGNORED_KEYS = ("_comment", "quantization_config", "torch_dtype", "dtype", "transformers_version")
_UNSUPPORTED = {"plugin": "--plugin (quantized layers)"}


def _hf_config(path: Path) -> Any:
    """The transformers config of ``path`` (a ``config.json``), without its quantization and dtype entries."""
    import transformers

    from lightning_memkit.cli import ConfigError

    try:
        values = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"--hf-config: cannot read {path}: {err}") from err
    model_type = values.pop("model_type", None)
    if not model_type:
        raise ConfigError(f"--hf-config: {path} has no model_type")
    for key in _IGNORED_KEYS:
        values.pop(key, None)
    try:
        return transformers.AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError) as err:
        raise ConfigError(f"--hf-config: {path}: {err}") from err


def estimate_from_hf_config(path: str | Path, seq_len: int = 2048, batch_size: int = 1, precision: str = "32-true",
                            optimizer: str = "adamw", activation_checkpointing: bool = False,
                            fused_loss: bool = False) -> MemoryEstimate:
    """Estimate one training step of the causal LM described by the HF ``config.json`` at ``path``.

    The batch is ``input_ids`` and ``labels`` of ``(batch_size, seq_len)``; the loss is the model's own
    (``model(**batch).loss``), or :func:`~lightning_memkit.hf.fused_linear_cross_entropy` with ``fused_loss``;
    ``activation_checkpointing`` recomputes every decoder layer with the KV cache off, as
    :class:`~lightning_memkit.callbacks.ActivationCheckpointing` does. A ``quantization_config`` in the file is
    ignored: the weights are dense in the training dtype.
    """
    model, batch = _hf_factories(Path(path), seq_len, batch_size)
    return estimate_training_memory(model, batch, optimizer=optimizer, precision=precision,
                                    checkpoint="auto" if activation_checkpointing else None,
                                    patches=_hf_patches(activation_checkpointing, fused_loss))


def _hf_factories(path: Path, seq_len: int, batch_size: int) -> tuple[Any, Any]:
    """``(model_factory, batch_factory)`` of the causal LM in ``path``: random ``input_ids`` and ``labels``."""
    from lightning_memkit.cli import ConfigError

    if not path.is_file():
        raise ConfigError(f"--hf-config: no such file: {path}")
    seq_len = check_int(seq_len, "seq_len", minimum=1, owner="memkit estimate")
    batch_size = check_int(batch_size, "batch_size", minimum=1, owner="memkit estimate")
    config = _hf_config(path)
    vocab = int(config.vocab_size)

    def model() -> torch.nn.Module:
        import transformers

        return transformers.AutoModelForCausalLM.from_config(config)

    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (batch_size, seq_len))
        return {"input_ids": ids, "labels": torch.randint(0, vocab, (batch_size, seq_len))}

    return model, batch


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
                         activation_checkpointing: bool = False, fused_loss: bool = False) -> PipelineEstimate:
    """Per-rank peaks of the causal LM of ``path`` under ``memkit_pipeline`` (``stages`` ranks, 1F1B).

    The strategy's own planning on fake tensors: :func:`~lightning_memkit.hf.pipeline_stages.causal_lm_stages`
    cuts the model, :func:`~lightning_memkit.pipeline.runtime.measure_pipeline_costs` measures each layer on one
    microbatch (``batch_size / microbatches`` sequences) and
    :func:`~lightning_memkit.pipeline.partition_layers` picks the split and predicts each rank's peak.
    """
    import time

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from lightning_memkit.hf.pipeline_stages import causal_lm_stages
    from lightning_memkit.memory.estimate import build_model, default_dtype, precision_dtype, resolve_optimizer
    from lightning_memkit.memory.estimate_trace import fake_tensors
    from lightning_memkit.pipeline import partition_layers
    from lightning_memkit.pipeline.runtime import measure_pipeline_costs

    microbatches = microbatches or stages
    model, batch = _hf_factories(Path(path), seq_len, batch_size // microbatches or 1)
    start = time.perf_counter()
    with fake_tensors(), contextlib.ExitStack() as stack:
        net = build_model(model, precision)
        for patch in _hf_patches(activation_checkpointing, False):
            stack.enter_context(patch(net))
        if activation_checkpointing:
            from lightning_memkit.memory import checkpoint_modules, repeated_blocks

            stack.enter_context(checkpoint_modules(repeated_blocks(net)))
        with unset_fake_temporarily():  # the split wraps the fake modules; its self-checks run on real numbers
            split = causal_lm_stages(net, fused_loss=fused_loss)
            inputs, target = split.inputs(batch())
        opt = resolve_optimizer(optimizer, None)[0](net)
        with torch.random.fork_rng(), default_dtype(precision_dtype(precision)):
            costs = measure_pipeline_costs(list(split.layers), inputs, target, loss_fn=split.loss, optimizer=opt)
        parameters = sum(p.numel() for p in net.parameters())
    partition = partition_layers(costs, stages, schedule="1f1b", microbatches=microbatches)
    return PipelineEstimate(partition, parameters, time.perf_counter() - start)


def _hf_patches(activation_checkpointing: bool, fused_loss: bool) -> list[Any]:
    """The KV cache off under checkpointing (as ``ActivationCheckpointing`` does), the fused loss if asked."""
    from lightning_memkit.hf import fused_linear_cross_entropy
    from lightning_memkit.hf.layers import kv_cache_off

    patches = [kv_cache_off] if activation_checkpointing else []
    return patches + ([fused_linear_cross_entropy] if fused_loss else [])


# -- a memkit / LightningCLI config ---------------------------------------------------------------------------
def _class_name(entry: Any) -> str:
    path = entry.get("class_path", "") if isinstance(entry, dict) else str(entry or "")
    return path.rpartition(".")[2]


def _config_features(trainer: dict[str, Any]) -> dict[str, Any]:
    """Checkpointing, fused loss and precision from the trainer section of a parsed config."""
    from lightning_memkit.cli import ConfigError

    callbacks = [_class_name(c) for c in trainer.get("callbacks") or []]
    plugins = [_class_name(p) for p in trainer.get("plugins") or []]
    if plugins or _class_name(trainer.get("strategy")) == "MemkitPipelineStrategy" \
            or trainer.get("strategy") == "memkit_pipeline":
        raise ConfigError("trainer: memkit estimate does not estimate precision plugins or the pipeline strategy "
                          "yet; remove them to estimate the plain step")
    precision = str(trainer.get("precision") or "32-true")
    if precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision: {precision!r} is not estimated; allowed: {', '.join(PRECISIONS)}")
    return {"checkpoint": "ActivationCheckpointing" in callbacks, "fused": "FusedLinearCrossEntropy" in callbacks,
            "precision": precision}


def _first_batch(datamodule: Any) -> Any:
    datamodule.prepare_data()
    datamodule.setup("fit")
    return next(iter(datamodule.train_dataloader()))


def _step_loss(module: Any, batch: Any) -> torch.Tensor:
    out = module.training_step(batch, 0)
    return out["loss"] if isinstance(out, dict) else out


def estimate_from_config(config: str | Path, overrides: Sequence[str] = ()) -> MemoryEstimate:
    """Estimate one training step of a memkit/LightningCLI config: its model (``class_path``), the first batch
    of its data module, its ``configure_optimizers``, precision, ``ActivationCheckpointing`` and
    ``FusedLinearCrossEntropy``."""
    import warnings

    from lightning_memkit.cli import ConfigError
    from lightning_memkit.compare import _parse

    config = Path(config)
    if not config.is_file():
        raise ConfigError(f"--config: no such file: {config}")
    parsed = _parse(config, [str(a) for a in overrides])
    features = _config_features(parsed.get("trainer") or {})
    model_entry, data_entry = parsed["model"], parsed["data"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = _first_batch(_instantiate(data_entry))
    patches = _hf_patches(features["checkpoint"], features["fused"])
    return estimate_training_memory(lambda: _instantiate(model_entry), lambda: batch, loss_fn=_step_loss,
                                    optimizer=_configured_optimizer, precision=features["precision"],
                                    checkpoint="auto" if features["checkpoint"] else None, patches=patches)


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
                "activation_checkpointing": False, "fused_loss": False}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="memkit estimate", exit_on_error=False, allow_abbrev=False,
        description="Predict the device memory of a training step (steady state: optimizer state allocated) "
        "without allocating it: the model runs on fake tensors. Give --hf-config or --config; the options "
        "after --hf-config describe the run (a --config says them itself; override its keys as in memkit fit).",
    )
    p.add_argument("-c", "--config", default=None, help="a memkit / LightningCLI YAML config")
    p.add_argument("--hf-config", default=None, help="a Hugging Face config.json of a causal LM")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per batch (default 1)")
    p.add_argument("--precision", default=None, help=f"one of {', '.join(PRECISIONS)} (default 32-true)")
    p.add_argument("--optimizer", default=None, help="adamw (default) or sgd (momentum 0.9)")
    p.add_argument("--activation-checkpointing", action="store_true", default=None,
                   help="recompute every decoder layer")
    p.add_argument("--fused-loss", action="store_true", default=None,
                   help="fused linear cross-entropy: no (B, T, V) logits")
    p.add_argument("--plugin", default=None, help="not estimated yet")
    p.add_argument("--pipeline", type=int, default=None,
                   help="ranks of a memkit_pipeline (1F1B): per-rank peaks of the split it would choose")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step with --pipeline (default 4, the strategy's; divides --batch-size)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON instead of the table")
    return p


def _check(args: argparse.Namespace) -> None:
    """Refuse contradictory or unsupported options; fill the --hf-config defaults."""
    from lightning_memkit.cli import ConfigError

    if (args.config is None) == (args.hf_config is None):
        raise ConfigError("give exactly one of --config path/to/config.yaml or --hf-config path/to/config.json")
    for key, label in _UNSUPPORTED.items():
        if getattr(args, key) is not None:
            raise ConfigError(f"{label} is not supported by memkit estimate yet; leave it out")
    given = [f"--{k.replace('_', '-')}" for k in _HF_DEFAULTS if getattr(args, k) is not None]
    if args.config is not None and given:
        raise ConfigError(f"{', '.join(given)}: with --config the config says these; override its keys instead "
                          "(--trainer.precision bf16-true, --data.init_args.seq_len 512, ...)")
    for key, default in _HF_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    if args.precision not in PRECISIONS:
        raise ConfigError(f"--precision: {args.precision!r} is not supported; allowed: {', '.join(PRECISIONS)}")
    if args.optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer: {args.optimizer!r} is not supported; allowed: {', '.join(OPTIMIZERS)}")
    for key in ("seq_len", "batch_size"):
        if getattr(args, key) < 1:
            raise ConfigError(f"--{key.replace('_', '-')}: must be >= 1, got {getattr(args, key)}")
    _check_pipeline(args)


def _check_pipeline(args: argparse.Namespace) -> None:
    from lightning_memkit.cli import ConfigError

    if args.pipeline is None:
        if args.microbatches is not None:
            raise ConfigError("--microbatches: only with --pipeline N")
        return
    if args.config is not None:
        raise ConfigError("--pipeline: only with --hf-config (a --config sets its strategy itself)")
    if args.pipeline < 2:
        raise ConfigError(f"--pipeline: must be >= 2 ranks, got {args.pipeline}")
    args.microbatches = 4 if args.microbatches is None else args.microbatches
    if args.microbatches < 1 or args.batch_size % args.microbatches:
        raise ConfigError(f"--microbatches: must be >= 1 and divide --batch-size {args.batch_size}, "
                          f"got {args.microbatches}")


def main(argv: Sequence[str] | None = None) -> MemoryEstimate | PipelineEstimate:
    """``memkit estimate ...``: print the table (or ``--json``); bad arguments raise ``ConfigError``."""
    from lightning_memkit.cli import ConfigError, parse_subcommand, report_console

    args, overrides = parse_subcommand(_parser(), argv)
    _check(args)
    if args.hf_config is not None:
        if overrides:
            raise ConfigError(f"unrecognized arguments: {' '.join(overrides)}")
        run = (dict(stages=args.pipeline, microbatches=args.microbatches) if args.pipeline else {})
        fn = estimate_hf_pipeline if args.pipeline else estimate_from_hf_config
        est = fn(args.hf_config, seq_len=args.seq_len, batch_size=args.batch_size, precision=args.precision,
                 optimizer=args.optimizer, activation_checkpointing=args.activation_checkpointing,
                 fused_loss=args.fused_loss, **run)
    else:
        est = estimate_from_config(args.config, overrides)
    if args.json:
        print(est.to_json())
        return est
    console = report_console()
    if isinstance(est, MemoryEstimate):
        console.print(est.table())
    console.print(est.notes(), markup=False, highlight=False, soft_wrap=True)
    return est
