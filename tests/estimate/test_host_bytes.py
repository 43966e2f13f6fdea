"""Host memory in the estimate: offloaded storages count apart from the device bytes (CategoryTracker), the step's
host peak is ``MemoryEstimate.host_bytes``, exactly what LivePeak measures on CPU, and the composition carries it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_memkit.demo import TinyLM
from lightning_memkit.estimate.step import estimate_training_memory, resolve_optimizer, trace_training_step
from lightning_memkit.estimate.step_spec import StepSpec
from lightning_memkit.estimate.trace import CategoryTracker
from lightning_memkit.measure.live_peak import HOST, host_memory, note_host
from lightning_memkit.memory import LivePeak, checkpoint_modules
from lightning_memkit.offload import offload_blocks
from lightning_memkit.recompute.activation_recompute import repeated_blocks


def test_host_storages_are_in_no_category_and_no_phase_peak():
    with CategoryTracker() as tr:
        tr.start_phase("forward", "transient")
        a = torch.empty(256)  # 1 KiB on the device
        with host_memory():
            h = torch.empty(512)  # 2 KiB offloaded
        b = torch.empty(128)
        note_host(b)  # 512 B moved to the host after the fact
        tr.move_since(0, "transient", "saved activations")  # refiling host storages changes no total
        assert tr.totals["saved activations"] == 1024 and sum(tr.totals.values()) == 1024
        assert tr.live_bytes == 1024 and tr.host_live_bytes == 2560
        del h, b
        assert tr.host_live_bytes == 0 and sum(tr.totals.values()) == 1024
        del a
    assert tr.phase_peaks["forward"].peak_bytes == 1536  # a and b on the device before b moved
    assert tr.phase_peaks["forward"].split["transient"] == 1536  # the split at that high: a and b
    assert tr.host_peaks["forward"] == 2560 and tr.by_device[HOST].peak == 2560


def tiny_lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(d_model=32, n_layers=4, n_heads=2, seq_len=64)


def batch() -> torch.Tensor:
    return torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(0))


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def real_host_peak(checkpoint: str | None) -> int:
    """LivePeak over a real steady-state step (the second) with the same offload: its host peak."""
    model = tiny_lm()
    handles = [checkpoint_modules(repeated_blocks(model))] if checkpoint else []
    handles.append(offload_blocks(model))
    try:
        lm_loss(model, batch()).backward()
        with LivePeak() as lp:
            lm_loss(model, batch()).backward()
    finally:
        for h in reversed(handles):
            h.restore()
    return lp.host_peak_bytes


@pytest.mark.parametrize("checkpoint", [None, "auto"])
def test_offload_lowers_the_device_peak_and_host_bytes_equal_livepeak(checkpoint):
    kw = dict(loss_fn=lm_loss, optimizer="sgd", checkpoint=checkpoint)
    without = estimate_training_memory(tiny_lm, batch, **kw)
    with_offload = estimate_training_memory(tiny_lm, batch, patches=[offload_blocks], **kw)
    assert with_offload.peak_bytes < without.peak_bytes
    assert without.host_bytes == 0
    assert with_offload.host_bytes == real_host_peak(checkpoint) > 0  # exact on CPU
    assert with_offload.features[-1] == "offload_blocks"
    assert "host memory (offloaded) at its step peak" in with_offload.notes()
    assert with_offload.to_dict()["host_bytes"] == with_offload.host_bytes
    if checkpoint:  # a checkpointed block keeps its input only: one (8, 64, 32) float32 tensor per block
        assert with_offload.host_bytes == 4 * 8 * 64 * 32 * 4


def test_composed_step_carries_the_host_bytes(tmp_path):
    transformers = pytest.importorskip("transformers")
    from lightning_memkit.demo.hf_models import tiny_hf_config
    from lightning_memkit.estimate.compose import compose_step

    config = tiny_hf_config("llama", hidden_size=32, num_layers=8, use_cache=False)
    make_optimizer, _ = resolve_optimizer("adamw", None)
    ids = torch.randint(0, config.vocab_size, (1, 16))

    def trace(cfg, log=False):
        return trace_training_step(lambda: transformers.AutoModelForCausalLM.from_config(cfg),
                                   lambda: {"input_ids": ids, "labels": ids}, make_optimizer,
                                   StepSpec(precision="bf16-true", patches=[offload_blocks]), fake_batch=True, log=log)

    composed, note = compose_step(config, lambda cfg: trace(cfg, log=True))
    full = trace(config)
    assert note.startswith("composed from traces at depths")
    assert composed.host_bytes == full.host_bytes > 0
    assert composed.phases == full.phases
