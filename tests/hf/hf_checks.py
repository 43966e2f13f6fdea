"""What several tests of tiny HF models share: the dense reference of QLoRA-adapted weights, and one short fit and
test with the measuring and releasing callbacks, checked."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from lightning_memkit.hf import QLoRAExperts, dequantized_experts
from lightning_memkit.ops.nosave_matmul import dequantize_weight


def lora_weights(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Leaf copies of the adapters, and each adapted weight as its dequantized value plus the adapter's update."""
    import bitsandbytes as bnb

    leaves, weights = {}, {}
    for name, m in model.named_modules():
        if isinstance(m, QLoRAExperts):
            dense = dequantized_experts(m)
            for proj, lora in m.lora.items():
                a, b = (leaves.setdefault(f"{name}.lora.{proj}.{k}", getattr(lora, k).detach().clone()
                                          .requires_grad_()) for k in ("A", "B"))
                delta = torch.bmm(a, b) * lora.scaling  # (E, in, out)
                weights[f"{name}.{proj}"] = dense[proj] + (delta if m.is_transposed else delta.transpose(1, 2))
        elif isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) and m._modules.get("lora") is not None:
            a, b = (leaves.setdefault(f"{name}.lora.{k}", getattr(m.lora, k).detach().clone().requires_grad_())
                    for k in ("A", "B"))
            weights[f"{name}.weight"] = dequantize_weight(m, torch.float32) + b @ a * m.lora.scaling
    return leaves, weights


def check_measuring_callbacks(module, tmp_path: Path) -> None:
    """Fit ``module`` (an HF causal LM at ``module.model``, 2 decoder layers) 2 steps and test it with
    PeakMemoryMonitor, SavedTensorProfiler, PhaseMemoryRelease and StageBoundaryRelease added to the Trainer and
    nothing else; check what each reports."""
    import lightning as L

    from lightning_memkit.callbacks import (
        PeakMemoryMonitor,
        PhaseMemoryRelease,
        SavedTensorProfiler,
        StageBoundaryRelease,
    )
    from lightning_memkit.demo import ByteTextDataModule

    monitor = PeakMemoryMonitor(cpu_sample_every_n_steps=1)
    profiler = SavedTensorProfiler(every_n_steps=1, depth=4, output_dir=tmp_path)
    release = PhaseMemoryRelease(after=("fit", "test"), strict=True)
    boundary = StageBoundaryRelease()
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        limit_test_batches=2, callbacks=[monitor, profiler, release, boundary])
    data = ByteTextDataModule(batch_size=2, seq_len=32, batch_format="hf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data)
    trainer.test(module, data, verbose=False)

    report = profiler.last_report  # the per-step peak covers the profiled forward and backward of the same step
    assert monitor.summary["measured_steps"] == 2
    assert monitor.summary["max_step_peak_bytes"] >= report.peak_bytes > 0
    rows = {row.name: row.activation_bytes for row in report.rows}  # each decoder layer keeps activations
    assert all(rows[f"model.model.layers.{i}"] > 0 for i in range(2))
    # fit released exactly AdamW's state (two fp32 moments per trainable element, one fp32 step each)
    trainable = [p for p in module.parameters() if p.requires_grad]
    fit_result, test_result = release.results
    assert (fit_result.stage, test_result.stage) == ("fit", "test")
    assert fit_result.optimizer_state_bytes == sum(2 * 4 * p.numel() + 4 for p in trainable)
    assert fit_result.retained_bytes <= release.tolerance_bytes
    assert "test_loss" in trainer.callback_metrics
    # nothing marked in HF code: said once, nothing freed
    assert sum("no stage_boundary() mark ran" in str(w.message) for w in caught) == 1
    assert boundary.released_bytes == 0
