import csv
import gc
import json
import weakref
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_memkit.callbacks import SavedTensorProfiler
from lightning_memkit.measure import live_peak as live_peak_module
from lightning_memkit.memory import profile_saved_tensors


class TinyModule(L.LightningModule):
    def __init__(self, fail_at_step: int | None = None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.fail_at_step = fail_at_step

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at_step:
            self.net[0](batch[0])
            raise ValueError("step failed")
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(24, 16, generator=g), torch.randn(24, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


def make_trainer(tmp_path, callback, steps=3):
    return L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, logger=CSVLogger(tmp_path), callbacks=[callback], log_every_n_steps=1,
    )


def test_profiles_chosen_steps_writes_files_and_logs(tmp_path):
    profiler = SavedTensorProfiler(every_n_steps=2, depth=None)
    trainer = make_trainer(tmp_path, profiler)
    model = TinyModule()
    trainer.fit(model)

    log_dir = Path(trainer.logger.log_dir)
    names = sorted(p.name for p in profiler.written)
    assert names == [f"saved_tensors_step{s}.{e}" for s in (0, 2) for e in ("json", "png")]
    assert all(p.parent == log_dir and p.is_file() for p in profiler.written)
    assert (log_dir / "saved_tensors_step2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    report = profiler.last_report
    data = json.loads((log_dir / "saved_tensors_step2.json").read_text())
    assert data["step"] == 2
    assert data["total_activation_bytes"] == report.total_activation_bytes
    assert data["peak_bytes"] == report.peak_bytes >= report.forward_peak_bytes > 0

    # the model rows match a direct profile of the same forward (batch 2 of 3 has the same shapes)
    direct = profile_saved_tensors(model.net, torch.randn(8, 16))
    by_name = {r.name: r for r in report.rows}
    for row in direct.rows:
        got = by_name[f"net.{row.name}"]
        assert (got.activation_bytes, got.weight_bytes, got.num_tensors) == (
            row.activation_bytes, row.weight_bytes, row.num_tensors
        )
    # mse_loss, run in training_step outside any submodule, saves the prediction and the target
    assert by_name[""].activation_bytes == 2 * 8 * 4

    with open(log_dir / "metrics.csv") as f:
        logged = [r for r in csv.DictReader(f) if r.get("memkit/saved_activation_bytes")]
    assert [int(r["step"]) for r in logged] == [0, 2]
    assert float(logged[-1]["memkit/saved_activation_bytes"]) == report.total_activation_bytes
    assert float(logged[-1]["memkit/saved_weight_bytes"]) == report.total_weight_bytes

    # nothing of the profiler's own keeps the model alive (Lightning itself attaches the module's
    # log/log_dict to every callback: drop those to see the profiler's state alone)
    ref = weakref.ref(model)
    del trainer, model, profiler.log, profiler.log_dict
    gc.collect()
    assert ref() is None


def test_depth_and_output_dir(tmp_path):
    out = tmp_path / "profiles"
    profiler = SavedTensorProfiler(every_n_steps=100, depth=1, output_dir=str(out), max_rows=1)
    for _ in range(2):  # a second fit starts again at step 0 and is profiled again
        make_trainer(tmp_path, profiler).fit(TinyModule())
    assert sorted(p.name for p in out.iterdir()) == ["saved_tensors_step0.json", "saved_tensors_step0.png"]
    assert len(profiler.written) == 4
    assert [r.name for r in profiler.last_report.rows] == ["", "net"]


def test_failed_step_leaves_nothing_installed(tmp_path):
    profiler = SavedTensorProfiler(every_n_steps=1)
    model = TinyModule(fail_at_step=1)
    with pytest.raises(ValueError, match="step failed"):
        make_trainer(tmp_path, profiler).fit(model)
    assert profiler._recorder is None
    assert live_peak_module._ACTIVE == []
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert [p.name for p in profiler.written] == ["saved_tensors_step0.json", "saved_tensors_step0.png"]


def test_schedule():
    p = SavedTensorProfiler(every_n_steps=3, first_step=2)
    assert [s for s in range(12) if p.should_profile(s)] == [2, 5, 8, 11]
    assert [s for s in range(5) if SavedTensorProfiler(every_n_steps=2).should_profile(s)] == [0, 2, 4]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"every_n_steps": 0}, ValueError, "every_n_steps"),
        ({"every_n_steps": 1.5}, ValueError, "every_n_steps"),
        ({"every_n_steps": True}, ValueError, "every_n_steps"),
        ({"depth": 0}, ValueError, "depth"),
        ({"first_step": -1}, ValueError, "first_step"),
        ({"max_rows": 0}, ValueError, "max_rows"),
        ({"output_dir": 3}, TypeError, "output_dir"),
    ],
)
def test_invalid_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        SavedTensorProfiler(**kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_cuda_step(tmp_path, precision):
    profiler = SavedTensorProfiler(every_n_steps=100, depth=None)
    trainer = L.Trainer(
        max_steps=1, accelerator="gpu", devices=1, precision=precision, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, logger=CSVLogger(tmp_path), callbacks=[profiler],
    )
    trainer.fit(TinyModule())
    report = profiler.last_report
    assert len(profiler.written) == 2
    assert {s.device for s in report.storages} == {f"cuda:{torch.cuda.current_device()}"}
    net2 = {r.name: r for r in report.rows}["net.2"]
    if precision == "32-true":
        assert (net2.weight_bytes, net2.activation_bytes) == (32 * 4, 0)
    else:  # autocast saves a new bf16 copy of the weight: memory that exists only for backward
        assert (net2.weight_bytes, net2.activation_bytes) == (0, 32 * 2)
