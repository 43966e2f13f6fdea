from pathlib import Path

import pytest
import torch

from lightning_memkit.cli import main

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny_lm.yaml"
TINY = [
    "--trainer.max_steps", "3", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    "--model.d_model", "32", "--model.n_layers", "1", "--model.n_heads", "2", "--model.seq_len", "32",
    "--data.seq_len", "32", "--data.batch_size", "4", "--data.max_bytes", "20000",
]


def demo_args(tmp_path):
    return ["fit", "--config", str(CONFIG), "--trainer.default_root_dir", str(tmp_path),
            "--trainer.logger.init_args.save_dir", str(tmp_path), *TINY]


def test_demo_config_prints_the_memory_report(tmp_path, capsys):
    main(args=demo_args(tmp_path))
    out = capsys.readouterr().out
    report = out[out.index("memkit memory report"):]
    # PeakMemoryMonitor summary, printed once (in the report, not also at the end of training)
    assert out.count("Peak memory per training step") == 1
    assert "cpu (LivePeak)" in report and "max step peak" in report
    # SavedTensorProfiler: per-layer table and where its files went
    assert "blocks.0" in report and "Saved-tensor report written to:" in report
    written = [Path(line.strip()) for line in report.splitlines() if line.strip().endswith((".json", ".png"))]
    assert {p.suffix for p in written} == {".json", ".png"} and all(p.is_file() for p in written)
    assert all(tmp_path in p.parents for p in written)
    # first and last loss
    assert "train loss: first" in report and "over 3 steps" in report


def test_other_module_by_class_path(tmp_path, capsys):
    args = [
        "fit", "--model", "lightning_memkit.demo.TinyLM", "--data", "lightning_memkit.demo.ByteTextDataModule",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.accelerator", "cpu", "--trainer.logger", "false",
        "--trainer.enable_checkpointing", "false", *TINY,
    ]
    main(args=args)
    out = capsys.readouterr().out
    assert "No memkit memory callback ran" in out  # no memory callbacks configured
    assert "train loss: first" in out


def test_torch_num_threads_applies_to_the_run_only(tmp_path, monkeypatch):
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n)))
    before = torch.get_num_threads()
    main(args=[*demo_args(tmp_path), "--trainer.max_steps", "1", "--torch_num_threads", "3"])
    assert calls == [3, before]
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match=r"MemkitCLI\(torch_num_threads=0\): must be an int >= 1 or None"):
        main(args=["fit", "--config", str(CONFIG), "--torch_num_threads", "0"])


def test_bad_model_argument_is_reported():
    with pytest.raises(ValueError, match=r"loss='chunked'\) is not supported; allowed: 'standard', 'fused'"):
        main(args=["fit", "--config", str(CONFIG), "--model.loss", "chunked", "--trainer.logger", "false"])


def test_fused_loss_from_the_config(tmp_path, capsys):
    main(args=[*demo_args(tmp_path), "--model.loss", "fused"])
    report = capsys.readouterr().out
    report = report[report.index("memkit memory report"):]
    assert "train loss: first" in report and "over 3 steps" in report
    assert "max step peak" in report
