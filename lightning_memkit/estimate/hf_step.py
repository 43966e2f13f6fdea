"""The fake step of a causal LM from an HF ``config.json``, as a plan gives it
(:class:`~lightning_memkit.estimate.step_spec.StepSpec`): on one device (:func:`estimate_hf_step`, composed from a
few layers for deep models) or split into pipeline stages (:func:`estimate_pipeline_step`); the settings a run of
it checks.

Example (a tiny Llama's step of one fake sequence, bf16)::

    >>> from lightning_memkit.demo.hf_models import tiny_hf_config
    >>> from lightning_memkit.estimate.hf_step import estimate_hf_step
    >>> from lightning_memkit.estimate.step_spec import StepSpec
    >>> config = tiny_hf_config("llama", vocab_size=1000)
    >>> est = estimate_hf_step(config, StepSpec(precision="bf16-true", rows=1), seq_len=16, optimizer="sgd")
    >>> est.phases[0].weights - 2 * est.parameters   # bf16 weights; the rest: rotary buffer
    80
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memkit.common.batches import rng_untouched
from lightning_memkit.estimate.step import (
    CHECKPOINT_MODES,
    OPTIMIZERS,
    PRECISIONS,
    TARGETS,
    MemoryEstimate,
    StepTrace,
    resolve_optimizer,
    trace_steady_step,
)
from lightning_memkit.estimate.step_spec import StepSpec

__all__ = ["COMPOSE_FROM_LAYERS", "PipelineEstimate", "check_choices", "checkpoint_mode", "decoder_layer_policy",
           "estimate_hf_step", "estimate_pipeline_step", "model_factory", "token_batch"]


def estimate_hf_step(config: Any, step: StepSpec, *, seq_len: int, optimizer: str = "adamw",
                     compose: bool | str = "auto") -> MemoryEstimate:
    """The estimate of ``step`` (a plan's fake step, :class:`~lightning_memkit.estimate.step_spec.StepSpec`) on the
    causal LM of the HF ``config`` (read and checked): ``step.rows`` fake sequences of ``seq_len`` tokens, the model
    built in ``step.dtype`` (a checkpoint loaded in it; ``None``: the config class's); ``compose`` as
    :func:`estimate_from_hf_config`'s."""
    start = time.perf_counter()
    make_optimizer, optimizer_name = step.wrap_optimizer(*resolve_optimizer(optimizer, None))
    batch = token_batch(config.vocab_size, seq_len, step.rows)

    def trace(cfg: Any, log: bool) -> StepTrace:  # the first step's state made directly where it can be
        return trace_steady_step(model_factory(cfg, step.dtype), batch, make_optimizer, step, fake_batch=True,
                                 log=log)

    if step.fused_loss:  # imported once here, not in each process tracing a sample
        import lightning_memkit.hf.fused_loss  # noqa: F401
    notes = []
    traced = None
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    wanted = compose is True or (compose == "auto" and layers > COMPOSE_FROM_LAYERS)
    if wanted:
        from lightning_memkit.estimate.compose import NotComposable, compose_step

        try:
            traced, note = compose_step(config, lambda cfg: trace(cfg, log=True),
                                        max_layers=layers if compose == "auto" else None)
            notes.append(note)
        except NotComposable as err:
            notes.append(f"traced all {layers} layers: the step did not compose from its layers ({err})")
    if traced is None:
        traced = trace(config, log=False)
    est = traced.estimate(optimizer_name, time.perf_counter() - start)
    est.assumptions += notes + quadratic_tensors(traced, seq_len, config)
    return est


def quadratic_tensors(traced: StepTrace, seq_len: int, config: Any) -> list[str]:
    """A line naming the family and the module that made the step's largest ``(seq_len x seq_len)`` tensor (a
    materialized attention mask or score matrix: memory that grows with the square of the sequence), or nothing;
    nothing either where ``seq_len`` is one of the config's sizes (a ``(..., tokens, head_dim)`` tensor would look
    square)."""
    sizes = {v for k, v in vars(config).items() if isinstance(v, int) and k.endswith(("_size", "_dim"))}
    heads = getattr(config, "num_attention_heads", 0) or 0
    sizes.add(getattr(config, "hidden_size", 0) // heads if heads else 0)
    found = traced.largest.squares.get(seq_len) if traced.largest is not None and seq_len > 1 else None
    if found is None or seq_len in sizes:
        return []
    family = getattr(config, "model_type", "") or "the model"
    from lightning_memkit.measure.storage import format_bytes

    nbytes, module = found
    return [f"{family} materializes a ({seq_len:,} x {seq_len:,}) tensor in {module or 'the model'} "
            f"({format_bytes(nbytes)}, an attention mask or score matrix): its memory grows with the square of the "
            "sequence"]


#: ``compose="auto"`` composes models of more layers than this (depths 3, 4 and 5 trace 12 layers, and each sample
#: repeats the embedding, head and loss)
COMPOSE_FROM_LAYERS = 16


def decoder_layer_policy(_name: str, module: torch.nn.Module) -> bool:
    """The modules ``ActivationCheckpointing`` recomputes in a transformers model: its decoder layers."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return isinstance(module, GradientCheckpointingLayer)


def model_factory(config: Any, dtype: torch.dtype | None = None) -> Any:
    def model() -> torch.nn.Module:
        import transformers

        return transformers.AutoModelForCausalLM.from_config(config, **({"dtype": dtype} if dtype else {}))

    return model


def token_batch(vocab: int, seq_len: int, rows: int) -> Any:
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


def estimate_pipeline_step(config: Any, step: StepSpec, *, microbatches: int, seq_len: int, batch_size: int,
                           optimizer: str = "adamw") -> PipelineEstimate:
    """:func:`estimate_hf_pipeline` of a plan's fake ``step`` (its ``world.pipeline`` stages) on the causal LM of the
    HF ``config`` (read and checked): the step's precision, patches and recomputation; the stages fuse the loss
    themselves where ``step.fused_loss``."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from lightning_memkit.estimate.step import build_model, default_dtype, precision_dtype
    from lightning_memkit.estimate.trace import fake_tensors
    from lightning_memkit.hf.pipeline_stages import causal_lm_stages
    from lightning_memkit.pipeline import partition_layers
    from lightning_memkit.pipeline.runtime import measure_pipeline_costs

    start = time.perf_counter()
    plugin = step.make_plugin()  # a QLoRA plugin converts the whole model first, as memkit_pipeline's setup does
    batch = token_batch(config.vocab_size, seq_len, batch_size // microbatches)
    with fake_tensors(), contextlib.ExitStack() as stack:
        net = build_model(model_factory(config, step.dtype), step.precision, plugin)
        for patch in step.patches:
            stack.enter_context(patch(net))
        if step.recompute:
            from lightning_memkit.recompute.activation_recompute import checkpoint_modules, repeated_blocks

            stack.enter_context(checkpoint_modules(repeated_blocks(net), mode=step.recompute))
        tokens = batch()  # fake input_ids and labels: no memory for them
        with unset_fake_temporarily():  # the split wraps the fake modules; its self-checks run on real numbers
            split = causal_lm_stages(net, fused_loss=step.fused_loss)
            # the padding mask HF reads (all ones: the causal mask is skipped as in a real run): real, one microbatch
            mask = torch.ones(tokens["input_ids"].shape, dtype=torch.int64)
        inputs, target = split.inputs({**tokens, "attention_mask": mask})
        opt = step.wrap_optimizer(*resolve_optimizer(optimizer, None))[0](net)
        forward = plugin.forward_context() if plugin is not None else default_dtype(precision_dtype(step.precision))
        with rng_untouched(), forward:
            costs = measure_pipeline_costs(list(split.layers), inputs, target, loss_fn=split.loss, optimizer=opt)
        parameters = sum(p.numel() for p in net.parameters())
    partition = partition_layers(costs, step.world.pipeline, schedule="1f1b", microbatches=microbatches)
    return PipelineEstimate(partition, parameters, time.perf_counter() - start)


def check_choices(**values: Any) -> None:
    """``precision=``, ``optimizer=``, ``device=``: each one that ``memkit estimate`` estimates, or ``ConfigError``."""
    from lightning_memkit.common.errors import ConfigError

    allowed = {"precision": PRECISIONS, "optimizer": OPTIMIZERS, "device": TARGETS}
    for key, value in values.items():
        if value not in allowed[key]:
            raise ConfigError(f"--{key}: {value!r} is not supported; allowed: {', '.join(allowed[key])}")
