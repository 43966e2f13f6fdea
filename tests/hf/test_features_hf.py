"""The measuring and releasing callbacks on tiny Hugging Face causal LMs, added to the Trainer and nothing else."""

import warnings

import pytest

transformers = pytest.importorskip("transformers")

import lightning as L  # noqa: E402

from lightning_memkit.callbacks import (  # noqa: E402
    PeakMemoryMonitor,
    PhaseMemoryRelease,
    SavedTensorProfiler,
    StageBoundaryRelease,
)
from lightning_memkit.demo import ByteTextDataModule, HFCausalLM  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gpt_oss"])
def test_monitor_profiler_and_release_on_hf_models(family, tmp_path):
    module = HFCausalLM(family=family, num_layers=2)
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

    # the per-step peak covers the profiled forward+backward of the same step
    report = profiler.last_report
    assert monitor.summary["measured_steps"] == 2
    assert monitor.summary["max_step_peak_bytes"] >= report.peak_bytes > 0
    # one row per decoder layer, each keeping activations for backward
    rows = {row.name: row.activation_bytes for row in report.rows}
    for i in range(2):
        assert rows[f"model.model.layers.{i}"] > 0
    # fit released exactly AdamW's state (two fp32 moments per trainable element, one fp32 step each)
    trainable = [p for p in module.parameters() if p.requires_grad]
    fit_result, test_result = release.results
    assert (fit_result.stage, test_result.stage) == ("fit", "test")
    assert fit_result.optimizer_state_bytes == sum(2 * 4 * p.numel() + 4 for p in trainable)
    assert fit_result.retained_bytes <= release.tolerance_bytes
    assert "test_loss" in trainer.callback_metrics
    # nothing marked in HF code: said once, nothing freed
    unmarked = [w for w in caught if "no stage_boundary() mark ran" in str(w.message)]
    assert len(unmarked) == 1 and boundary.released_bytes == 0
