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
    >>> from lightning_memkit.estimate.hf import estimate_from_hf_config
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "config.json"
    >>> _ = path.write_text(tiny_hf_config("llama", vocab_size=1000).to_json_string())
    >>> est = estimate_from_hf_config(path, seq_len=16, precision="bf16-true", optimizer="sgd")
    >>> est.parameters, est.phases[0].weights - 2 * est.parameters   # bf16 weights; the rest: rotary buffer
    (202048, 80)
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_memkit.common.batches import rng_untouched
from lightning_memkit.estimate.inputs import (
    check_pipeline,
    check_pipeline_family,
    check_positions,
    check_tokens,
    read_hf_config,
)
from lightning_memkit.estimate.step import (
    CHECKPOINT_MODES,
    OPTIMIZERS,
    PRECISIONS,
    TARGETS,
    MemoryEstimate,
    StepTrace,
    WarmupMismatch,
    resolve_optimizer,
    trace_training_step,
)

__all__ = ["DEFAULT_LORA_RANK", "PLUGINS", "PipelineEstimate", "check_choices", "checkpoint_mode",
           "estimate_from_hf_config", "estimate_hf_pipeline", "fused_linear_cross_entropy_inside", "hf_patches",
           "plugin_dtype", "qlora_plugin"]

DEFAULT_LORA_RANK = 16
PLUGINS = tuple(f"{mode}-lora" for mode in ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8"))


def estimate_from_hf_config(path: str | Path, seq_len: int = 2048, batch_size: int = 1, precision: str = "32-true",
                            optimizer: str = "adamw", activation_checkpointing: bool | str = False,
                            fused_loss: bool = False, plugin: str | None = None,
                            lora_rank: int = DEFAULT_LORA_RANK, accumulate: bool = False,
                            device: str = "cuda", compose: bool | str = "auto", patches: Sequence[Any] = (),
                            optimizer_wraps: Sequence[Any] = ()) -> MemoryEstimate:
    """Estimate one training step of the causal LM described by the HF ``config.json`` at ``path``.

    The batch is ``input_ids`` and ``labels`` of ``(batch_size, seq_len)``; the loss is the model's own
    (``model(**batch).loss``), or :func:`~lightning_memkit.hf.fused_linear_cross_entropy` with ``fused_loss``;
    ``activation_checkpointing`` (``True``/``"full"`` or ``"selective"``) recomputes every decoder layer with
    the KV cache off, as :class:`~lightning_memkit.callbacks.ActivationCheckpointing` does; ``plugin``
    (``"nf4-lora"``, ...: :data:`PLUGINS`) quantizes the model with
    :class:`~lightning_memkit.plugins.NoSaveBitsandbytesPrecision` in ``precision``'s dtype with LoRA adapters
    of ``lora_rank``, the model built in that dtype (a checkpoint loaded in it). A ``quantization_config`` in the
    file is ignored: the weights are dense in the training dtype unless ``plugin`` quantizes them. ``accumulate``:
    the batch is one micro-batch of several (``accumulate_grad_batches > 1``): the gradients stay alive through the
    step. ``device``: ``"cuda"`` adds the CUDA-only terms (``estimate_training_memory``'s ``target``), ``"cpu"``
    counts the step as it runs here.
    The token batch is fake (no memory). Every input is checked before any work
    (:mod:`lightning_memkit.estimate.inputs`): a bad one raises ``ConfigError`` (a ``ValueError``) naming it;
    sizes left to the config class's defaults and unknown keys warn (``InputWarning``).

    ``compose``: ``"auto"`` (default) composes the step from traces of the model cut to a few layers
    (:mod:`~lightning_memkit.estimate.compose`) where that traces fewer layers than the model has, ``True`` wherever
    it can, ``False`` traces the whole model. A composition that fails a check falls back to the whole model; the
    estimate's assumptions say which was done.
    """
    check_choices(precision=precision, optimizer=optimizer, device=device)
    if compose not in (True, False, "auto"):
        from lightning_memkit.common.errors import ConfigError

        raise ConfigError(f"compose: {compose!r} is not one of True, False, 'auto'")
    mode = checkpoint_mode(activation_checkpointing)
    qlora_plugin(plugin, precision, lora_rank)  # checked before any work
    seq_len, batch_size = check_tokens(seq_len, batch_size)
    config = read_hf_config(path)
    check_positions(seq_len, config, path)
    start = time.perf_counter()
    make_optimizer, optimizer_name = resolve_optimizer(optimizer, None)
    for wrap in optimizer_wraps:
        make_optimizer = wrap(make_optimizer)
        optimizer_name = getattr(make_optimizer, "__name__", optimizer_name)
    batch = _token_batch(config.vocab_size, seq_len, batch_size)
    # quantized: the checkpoint as loaded in the plugin's dtype (the plugin keeps what it does not quantize as loaded)
    dtype = plugin_dtype(precision) if plugin else None

    def trace(cfg: Any, log: bool) -> StepTrace:
        qlora = qlora_plugin(plugin, precision, lora_rank)  # a plugin per model it converts
        run = dict(loss_fn=None, precision="32-true" if qlora else precision,
                   checkpoint=(_hf_layer if mode else None, mode or "full"),
                   patches=[*hf_patches(bool(mode), fused_loss), *patches],
                   zero_grad="accumulate" if accumulate else "after_forward", plugin=qlora, target=device,
                   fake_batch=True, log=log)
        try:  # the first step's state made directly (half the work), checked by the recorded step
            return trace_training_step(_model_factory(cfg, dtype), batch, make_optimizer, warmup="synthetic", **run)
        except WarmupMismatch:
            return trace_training_step(_model_factory(cfg, dtype), batch, make_optimizer, **run)

    if fused_loss:  # imported once here, not in each process tracing a sample
        import lightning_memkit.hf.fused_loss  # noqa: F401
    notes = []
    step = None
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    if compose is True or (compose == "auto" and layers > COMPOSE_FROM_LAYERS):
        from lightning_memkit.estimate.compose import NotComposable, compose_step

        try:
            step, note = compose_step(config, lambda cfg: trace(cfg, log=True),
                                      max_layers=layers if compose == "auto" else None)
            notes.append(note)
        except NotComposable as err:
            notes.append(f"traced all {layers} layers: the step did not compose from its layers ({err})")
    if step is None:
        step = trace(config, log=False)
    est = step.estimate(optimizer_name, time.perf_counter() - start)
    est.assumptions += notes
    return est


#: ``compose="auto"`` composes models of more layers than this (depths 3, 4 and 5 trace 12 layers, and each sample
#: repeats the embedding, head and loss)
COMPOSE_FROM_LAYERS = 16


def _hf_layer(_name: str, module: torch.nn.Module) -> bool:
    """The modules ``ActivationCheckpointing`` recomputes in a transformers model: its decoder layers."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return isinstance(module, GradientCheckpointingLayer)


def _model_factory(config: Any, dtype: torch.dtype | None = None) -> Any:
    def model() -> torch.nn.Module:
        import transformers

        return transformers.AutoModelForCausalLM.from_config(config, **({"dtype": dtype} if dtype else {}))

    return model


def _token_batch(vocab: int, seq_len: int, rows: int) -> Any:
    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (rows, seq_len))
        return {"input_ids": ids, "labels": torch.randint(0, vocab, (rows, seq_len))}

    return batch


def checkpoint_mode(activation_checkpointing: bool | str | None) -> str | None:
    """``"full"``, ``"selective"`` or ``None`` (off) from ``True``/``False``/a mode name."""
    from lightning_memkit.common.errors import ConfigError

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
    from lightning_memkit.common.errors import ConfigError

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


def _hf_factories(path: Path, seq_len: int, batch_size: int, sequences: int | None = None,
                  dtype: torch.dtype | None = None) -> tuple[Any, Any, Any]:
    """``(model_factory, batch_factory)`` of the causal LM in ``path`` (built in ``dtype``, default the config
    class's): random ``input_ids`` and ``labels`` of ``sequences`` (default ``batch_size``) rows, made under the
    estimate's fake mode (no memory). Every input is checked first (:mod:`lightning_memkit.estimate.inputs`); returns
    the config too."""
    seq_len, batch_size = check_tokens(seq_len, batch_size)
    config = read_hf_config(path)
    check_positions(seq_len, config, path)
    return _model_factory(config, dtype), _token_batch(config.vocab_size, seq_len, sequences or batch_size), config


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
        from lightning_memkit.measure.storage import format_bytes

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

    from lightning_memkit.estimate.step import build_model, default_dtype, precision_dtype, resolve_optimizer
    from lightning_memkit.estimate.trace import fake_tensors
    from lightning_memkit.hf.pipeline_stages import causal_lm_stages
    from lightning_memkit.pipeline import partition_layers
    from lightning_memkit.pipeline.runtime import measure_pipeline_costs

    model, batch, microbatches, mode = _pipeline_inputs(path, stages, microbatches, seq_len, batch_size, precision,
                                                        optimizer, activation_checkpointing)
    start = time.perf_counter()
    with fake_tensors(), contextlib.ExitStack() as stack:
        net = build_model(model, precision)
        for patch in hf_patches(bool(mode), False):
            stack.enter_context(patch(net))
        if mode:
            from lightning_memkit.recompute.activation_recompute import checkpoint_modules, repeated_blocks

            stack.enter_context(checkpoint_modules(repeated_blocks(net), mode=mode))
        tokens = batch()  # fake input_ids and labels: no memory for them
        with unset_fake_temporarily():  # the split wraps the fake modules; its self-checks run on real numbers
            split = causal_lm_stages(net, fused_loss=fused_loss)
            # the padding mask HF reads (all ones: the causal mask is skipped as in a real run): real, one microbatch
            mask = torch.ones(tokens["input_ids"].shape, dtype=torch.int64)
        inputs, target = split.inputs({**tokens, "attention_mask": mask})
        opt = resolve_optimizer(optimizer, None)[0](net)
        with rng_untouched(), default_dtype(precision_dtype(precision)):
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


def hf_patches(activation_checkpointing: bool, fused_loss: bool) -> list[Any]:
    """The KV cache off under checkpointing (as ``ActivationCheckpointing`` does), the fused loss if asked."""
    from lightning_memkit.hf.layers import kv_cache_off

    patches = [kv_cache_off] if activation_checkpointing else []
    return patches + ([fused_linear_cross_entropy_inside] if fused_loss else [])


@contextlib.contextmanager
def fused_linear_cross_entropy_inside(module: torch.nn.Module) -> Any:
    """:func:`~lightning_memkit.hf.fused_linear_cross_entropy` on the causal LMs the ``FusedLinearCrossEntropy``
    callback would patch in ``module`` (its ``find_causal_lms``: itself, or those a LightningModule holds)."""
    from lightning_memkit.common.errors import ConfigError
    from lightning_memkit.hf import fused_linear_cross_entropy
    from lightning_memkit.hf.fused_loss import find_causal_lms

    try:
        models = find_causal_lms(module)
    except ValueError as err:
        raise ConfigError(f"fused loss (FusedLinearCrossEntropy, --fused-loss): {err}") from err
    with contextlib.ExitStack() as stack:
        for model in models:
            stack.enter_context(fused_linear_cross_entropy(model))
        yield


# -- a memkit / LightningCLI config ---------------------------------------------------------------------------




















# -- command line ------------------------------------------------------------------------------------------








def check_choices(**values: Any) -> None:
    """``precision=``, ``optimizer=``, ``device=``: each one that ``memkit estimate`` estimates, or ``ConfigError``."""
    from lightning_memkit.common.errors import ConfigError

    allowed = {"precision": PRECISIONS, "optimizer": OPTIMIZERS, "device": TARGETS}
    for key, value in values.items():
        if value not in allowed[key]:
            raise ConfigError(f"--{key}: {value!r} is not supported; allowed: {', '.join(allowed[key])}")












