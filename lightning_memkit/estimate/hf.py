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

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_memkit.estimate.hf_step import (
    COMPOSE_FROM_LAYERS,
    PipelineEstimate,
    check_choices,
    checkpoint_mode,
    decoder_layer_policy,
    estimate_hf_step,
    estimate_pipeline_step,
    model_factory,
    token_batch,
)
from lightning_memkit.estimate.inputs import (
    check_pipeline,
    check_pipeline_family,
    check_positions,
    check_tokens,
    read_hf_config,
)
from lightning_memkit.estimate.levers.fused_loss import fused_linear_cross_entropy_inside
from lightning_memkit.estimate.levers.quantization import DEFAULT_LORA_RANK, PLUGINS, plugin_dtype, qlora_plugin
from lightning_memkit.estimate.step import MemoryEstimate

__all__ = ["COMPOSE_FROM_LAYERS", "DEFAULT_LORA_RANK", "PLUGINS", "PipelineEstimate", "check_choices",
           "checkpoint_mode", "decoder_layer_policy", "estimate_from_hf_config", "estimate_hf_pipeline",
           "estimate_hf_step", "estimate_pipeline_step", "fused_linear_cross_entropy_inside", "plugin_dtype",
           "qlora_plugin"]

def estimate_from_hf_config(path: str | Path, seq_len: int = 2048, batch_size: int = 1, precision: str = "32-true",
                            optimizer: str = "adamw", activation_checkpointing: bool | str = False,
                            fused_loss: bool = False, plugin: str | None = None,
                            lora_rank: int = DEFAULT_LORA_RANK, accumulate: bool = False,
                            device: str = "cuda", compose: bool | str = "auto", patches: Sequence[Any] = (),
                            optimizer_wraps: Sequence[Any] = (), devices: int = 1) -> MemoryEstimate:
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

    ``devices``: the ranks the run trains on; above 1 the step is one rank's with the model sharded over them by
    FSDP2 (``memkit_fsdp2``, parameters freed after each unit's forward), estimated under a fake process group.
    """
    from lightning_memkit.estimate.hf_run import HFRun

    if compose not in (True, False, "auto"):
        from lightning_memkit.common.errors import ConfigError

        raise ConfigError(f"compose: {compose!r} is not one of True, False, 'auto'")
    run = HFRun(path, seq_len=seq_len, batch_size=batch_size, precision=precision, optimizer=optimizer,
                activation_checkpointing=activation_checkpointing, fused_loss=fused_loss, plugin=plugin,
                lora_rank=lora_rank, device=device, devices=devices)  # every input checked before any work
    step = run.step_spec(run.base.replace(sharding="full_shard" if run.devices > 1 else None))
    step.zero_grad = "accumulate" if accumulate else step.zero_grad
    step.patches += patches
    step.optimizer += optimizer_wraps
    return estimate_hf_step(run.config, step, seq_len=run.seq_len, optimizer=optimizer, compose=compose)


def _hf_factories(path: Path, seq_len: int, batch_size: int, sequences: int | None = None,
                  dtype: torch.dtype | None = None) -> tuple[Any, Any, Any]:
    """``(model_factory, batch_factory)`` of the causal LM in ``path`` (built in ``dtype``, default the config
    class's): random ``input_ids`` and ``labels`` of ``sequences`` (default ``batch_size``) rows, made under the
    estimate's fake mode (no memory). Every input is checked first (:mod:`lightning_memkit.estimate.inputs`); returns
    the config too."""
    seq_len, batch_size = check_tokens(seq_len, batch_size)
    config = read_hf_config(path)
    check_positions(seq_len, config, path)
    return model_factory(config, dtype), token_batch(config.vocab_size, seq_len, sequences or batch_size), config


def estimate_hf_pipeline(path: str | Path, stages: int, microbatches: int | None = None, seq_len: int = 2048,
                         batch_size: int = 1, precision: str = "32-true", optimizer: str = "adamw",
                         activation_checkpointing: bool | str = False, fused_loss: bool = False,
                         plugin: str | None = None, lora_rank: int = DEFAULT_LORA_RANK) -> PipelineEstimate:
    """Per-rank peaks of the causal LM of ``path`` under ``memkit_pipeline`` (``stages`` ranks, 1F1B).

    The strategy's own planning on fake tensors: :func:`~lightning_memkit.hf.pipeline_stages.causal_lm_stages`
    cuts the model, :func:`~lightning_memkit.pipeline.runtime.measure_pipeline_costs` measures each layer on one
    microbatch (``batch_size / microbatches`` sequences; ``microbatches`` defaults to ``stages``) and
    :func:`~lightning_memkit.pipeline.partition_layers` picks the split and predicts each rank's peak.
    A bad input (a family the pipeline does not split included) raises ``ConfigError`` before any work.
    """
    from lightning_memkit.estimate.hf_run import HFRun

    seq_len, batch_size = check_tokens(seq_len, batch_size)
    microbatches = check_pipeline(stages, microbatches, batch_size)
    run = HFRun(path, seq_len=seq_len, batch_size=batch_size, precision=precision, optimizer=optimizer,
                activation_checkpointing=activation_checkpointing, fused_loss=fused_loss, plugin=plugin,
                lora_rank=lora_rank)
    check_pipeline_family(run.config, path)
    return estimate_pipeline_step(run.config, run.step_spec(run.base.replace(stages=stages)),
                                  microbatches=microbatches, seq_len=seq_len, batch_size=batch_size,
                                  optimizer=optimizer)
