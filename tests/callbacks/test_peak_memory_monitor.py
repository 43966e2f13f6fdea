import json

import lightning as L
import pytest
import ranks
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, is_in_torch_dispatch_mode

from lightning_memkit.callbacks import PeakMemoryMonitor, SavedTensorProfiler
from lightning_memkit.measure import live_peak as live_peak_module
from lightning_memkit.memory import LivePeak

N = 4096  # bytes the step of AllocatingModule allocates per batch index


class CaptureLogger(Logger):
    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    @property
    def name(self):
        return "capture"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def values(self, key):
        return [(step, m[key]) for step, m in self.rows if key in m]


class AllocatingModule(L.LightningModule):
    """Step ``i`` allocates (and frees) exactly ``N * (i + 1)`` bytes and nothing else."""

    def __init__(self, batches=5, device="cpu"):
        super().__init__()
        self.automatic_optimization = False
        self.w = nn.Parameter(torch.zeros(1))
        self.batches = batches
        self.buffer_device = device

    def training_step(self, batch, batch_idx):
        buf = torch.empty(N * (batch_idx + 1), dtype=torch.uint8, device=self.buffer_device)
        del buf

    def configure_optimizers(self):
        return None

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(self.batches, 1), batch_size=1)


class LinearModule(L.LightningModule):
    def __init__(self, fail_at_step=None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.fail_at_step = fail_at_step

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at_step:
            raise ValueError("step failed")
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


class OuterSpan(Callback):
    """Opens its own LivePeak at batch start and closes it at batch end (after the monitor's end hook)."""

    def __init__(self):
        self.peaks = []
        self._lp = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._lp = LivePeak().__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._lp.__exit__(None, None, None)
        self.peaks.append(self._lp.peak_bytes)


def fit(module, callbacks, logger=None, **kwargs):
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, logger=logger if logger is not None else False, callbacks=callbacks, **kwargs,
    )
    trainer.fit(module)
    return trainer


def assert_no_mode_left():
    assert _get_current_dispatch_mode_stack() == []
    assert not is_in_torch_dispatch_mode()
    assert live_peak_module._ACTIVE == []


def test_step_peaks_are_exact_and_logged(capsys):
    logger = CaptureLogger()
    monitor = PeakMemoryMonitor(cpu_sample_every_n_steps=1)
    fit(AllocatingModule(), [monitor], logger)

    expected = [N * (i + 1) for i in range(5)]
    assert logger.values("memkit/step_peak_bytes") == [(i, float(b)) for i, b in enumerate(expected)]
    assert logger.values("memkit/peak_bytes") == [(5, float(max(expected)))]
    assert monitor.summary["max_step_peak_bytes"] == max(expected)
    assert monitor.summary["mean_step_peak_bytes"] == sum(expected) / len(expected)
    assert monitor.summary["measured_steps"] == 5
    assert monitor.summary["device"] == "cpu" and monitor.summary["method"] == "LivePeak"
    assert monitor.summary["max_step_peak_allocated_bytes"] is None
    out = capsys.readouterr().out
    assert "Peak memory per training step" in out and "20.00 KiB" in out  # 5 * 4096 bytes
    assert "20.00 KiB" in str(monitor)
    assert_no_mode_left()


def test_sampling_and_log_interval(capsys):
    logger = CaptureLogger()
    monitor = PeakMemoryMonitor(log_every_n_steps=2, cpu_sample_every_n_steps=2, verbose=False)
    fit(AllocatingModule(batches=6), [monitor], logger)

    # batches 0, 2, 4 are measured; the 1st and 3rd measured ones are logged
    assert logger.values("memkit/step_peak_bytes") == [(0, float(N)), (4, float(5 * N))]
    assert monitor.summary["measured_steps"] == 3
    assert monitor.summary["mean_step_peak_bytes"] == (N + 3 * N + 5 * N) / 3
    assert monitor.summary["sample_every_n_steps"] == 2
    assert capsys.readouterr().out == ""  # verbose=False prints nothing
    assert_no_mode_left()


def test_agrees_with_a_tracker_left_after_it():
    # the other tracker is still open when the monitor's end hook runs: the monitor leaves its own
    # from under it, and both see the same step
    span = OuterSpan()
    monitor = PeakMemoryMonitor(cpu_sample_every_n_steps=1, verbose=False)
    logger = CaptureLogger()
    fit(LinearModule(), [monitor, span], logger)

    logged = [v for _, v in logger.values("memkit/step_peak_bytes")]
    assert len(logged) == 4 and all(v > 0 for v in logged)
    assert logged == [float(p) for p in span.peaks]
    assert_no_mode_left()


@pytest.mark.parametrize("monitor_first", [True, False])
def test_whole_step_measured_in_either_order_with_the_profiler(tmp_path, monitor_first):
    # the profiler's tracker opens at batch start and closes at on_after_backward: nested inside the
    # monitor's when the monitor is listed first, overlapping it otherwise
    profiler = SavedTensorProfiler(every_n_steps=1, output_dir=tmp_path)
    monitor = PeakMemoryMonitor(cpu_sample_every_n_steps=1, verbose=False)
    logger = CaptureLogger()
    fit(LinearModule(), [monitor, profiler] if monitor_first else [profiler, monitor], logger)
    assert monitor.summary["measured_steps"] == 4
    last = logger.values("memkit/step_peak_bytes")[-1][1]
    assert last >= profiler.last_report.peak_bytes > 0  # the step contains forward + backward
    assert_no_mode_left()


def test_large_byte_counts_stay_exact():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    monitor = PeakMemoryMonitor(verbose=False)
    monitor.setup(trainer, None, "fit")
    big = 2**40 + 1  # not representable in float32
    for b in (big, big - 2, big - 4):
        monitor._record(trainer, b, None)
    monitor.on_train_end(trainer, None)
    assert monitor.summary["max_step_peak_bytes"] == big
    assert monitor.summary["mean_step_peak_bytes"] == big - 2


def test_tracker_closed_when_the_step_raises():
    monitor = PeakMemoryMonitor(cpu_sample_every_n_steps=1, verbose=False)
    with pytest.raises(ValueError, match="step failed"):
        fit(LinearModule(fail_at_step=1), [monitor])
    assert monitor.summary == {}
    assert_no_mode_left()


SYNC_WORKER = """
import json, os, types
from datetime import timedelta
import torch
import torch.distributed as dist
from lightning_memkit.callbacks import PeakMemoryMonitor

rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=30))
try:
    trainer = types.SimpleNamespace(
        strategy=types.SimpleNamespace(root_device=torch.device("cpu")), loggers=[], global_step=0,
        is_global_zero=rank == 0,
    )
    monitor = PeakMemoryMonitor(verbose=False)
    monitor.setup(trainer, None, "fit")
    for b in [1000 * (rank + 1), 10 * (rank + 1)] if rank == 0 else [1000 * (rank + 1)]:
        monitor._record(trainer, b, None)
    monitor.on_train_end(trainer, None)
    print("SUMMARY", json.dumps(monitor.summary))
finally:
    dist.destroy_process_group()
"""


def test_summary_is_synced_over_ranks():
    for rank, (code, out) in enumerate(ranks.wait(ranks.launch("-c", [SYNC_WORKER], 2), 120, "monitor sync")):
        assert code == 0, out[-3000:]
        summary = json.loads(next(line for line in out.splitlines() if line.startswith("SUMMARY "))[8:])
        assert summary["max_step_peak_bytes"] == 2000  # rank 1's step, seen by both ranks
        assert summary["mean_step_peak_bytes"] == (1000 + 10 + 2000) / 3
        assert summary["measured_steps"] == (2 if rank == 0 else 1)  # local count


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"log_every_n_steps": 0}, ValueError, r"PeakMemoryMonitor\(log_every_n_steps=0\): must be an int >= 1"),
        ({"log_every_n_steps": 1.5}, ValueError, "log_every_n_steps=1.5"),
        ({"log_every_n_steps": True}, ValueError, "log_every_n_steps=True"),
        ({"cpu_sample_every_n_steps": -2}, ValueError, "cpu_sample_every_n_steps=-2"),
        ({"device": "tpu"}, ValueError, "device='tpu'"),
        ({"device": -1}, ValueError, "device index must be >= 0"),
        ({"device": 1.0}, TypeError, "device must be None, int, str or torch.device"),
        ({"verbose": "yes"}, TypeError, "verbose"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        PeakMemoryMonitor(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_device_without_cuda():
    with pytest.raises(ValueError, match="CUDA is not available"):
        PeakMemoryMonitor(device="cuda")


@pytest.mark.cuda
def test_cuda_step_peaks_use_allocator_counters():
    logger = CaptureLogger()
    monitor = PeakMemoryMonitor(device="cuda", verbose=False)
    module = AllocatingModule(device="cuda")
    trainer = L.Trainer(
        accelerator="cuda", devices=1, max_epochs=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, logger=logger, callbacks=[monitor],
    )
    trainer.fit(module)
    expected = [float(N * (i + 1)) for i in range(5)]  # multiples of 512: no allocator rounding
    assert [v for _, v in logger.values("memkit/step_peak_bytes")] == expected
    allocated = [v for _, v in logger.values("memkit/step_peak_allocated_bytes")]
    assert all(a >= e for a, e in zip(allocated, expected))
    assert monitor.summary["method"] == "torch.cuda.max_memory_allocated"
    assert monitor.summary["max_step_peak_bytes"] == max(expected)


# -- static table at fit start, feature lines at the end, planning runs excluded, timeline ----------------------
class AdamModule(LinearModule):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def test_static_table_at_fit_start_and_feature_lines_at_the_end(capsys):
    from lightning_memkit.callbacks import StageBoundaryRelease

    monitor = PeakMemoryMonitor()
    fit(AdamModule(), [monitor, StageBoundaryRelease()], max_steps=1)
    table = monitor.static_table
    params = sum(p.numel() * 4 for p in AdamModule().parameters())  # 577 fp32 elements
    assert [r.name for r in table.rows] == ["net"] and table.total.param_bytes == params == 2308
    assert table.total.grad_bytes == params and table.grad_source == "expected"
    # AdamW, not stepped at fit start: exp_avg + exp_avg_sq per element, a 4-byte step per tensor (4 tensors)
    assert table.total.optimizer_bytes == 2 * params + 4 * 4 and table.optimizer_source == "expected"
    assert monitor.effects == [
        "StageBoundaryRelease: no stage_boundary release ran (no marked tensor in the training steps)"
    ]
    out = capsys.readouterr().out
    assert "Static memory per module" in out and "2,308" in out
    assert out.index("Static memory per module") < out.index("Peak memory per training step")
    assert "StageBoundaryRelease: no stage_boundary release ran" in out


def _ac_fit(order, budget):
    from lightning_memkit.callbacks import ActivationCheckpointing
    from lightning_memkit.demo import TinyLM

    class SGDTinyLM(TinyLM):  # no optimizer state: the step peak is forward + backward
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    model = SGDTinyLM(d_model=32, n_layers=2, n_heads=2, seq_len=64)
    data = torch.utils.data.TensorDataset(torch.randint(0, 256, (8, 64)), torch.randint(0, 256, (8, 64)))
    monitor = PeakMemoryMonitor(cpu_sample_every_n_steps=1, verbose=False)
    checkpointing = ActivationCheckpointing(budget_bytes=budget)
    callbacks = [monitor, checkpointing] if order == "monitor first" else [checkpointing, monitor]
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    return monitor, checkpointing


def test_planning_runs_are_not_part_of_the_step_peak():
    _, unconstrained = _ac_fit("monitor after", budget=10**9)
    baseline = unconstrained.plan.baseline_peak  # the first planning run: nothing recomputed
    first, checkpointing = _ac_fit("monitor first", budget=baseline - 1)  # the probes run inside the monitor's step
    after, _ = _ac_fit("monitor after", budget=baseline - 1)  # the monitor's tracker opens after the probes
    assert checkpointing.checkpointed and checkpointing.plan.baseline_peak == baseline
    assert after.summary["max_step_peak_bytes"] < baseline  # so a probe counted in the step would show
    assert first.summary["max_step_peak_bytes"] == after.summary["max_step_peak_bytes"]
    assert first.summary["mean_step_peak_bytes"] == after.summary["mean_step_peak_bytes"]
    assert_no_mode_left()


def test_cpu_timeline_png_of_one_step(tmp_path):
    logger = CaptureLogger()
    path = tmp_path / "sub" / "timeline.png"
    monitor = PeakMemoryMonitor(cpu_sample_every_n_steps=1, verbose=False, timeline=str(path))
    fit(LinearModule(), [monitor], logger, max_steps=2)
    assert monitor.timeline_path == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    samples, marks = monitor._timeline.samples, monitor._timeline.marks
    first_step_peak = logger.values("memkit/step_peak_bytes")[0][1]
    assert max(samples) == first_step_peak  # the plotted curve is the measured step
    assert [label for _, label in marks] == ["backward", "optimizer step"]
    assert 0 < marks[0][0] < marks[1][0] < len(samples)


def test_timeline_true_writes_into_default_root_dir(tmp_path):
    monitor = PeakMemoryMonitor(cpu_sample_every_n_steps=1, verbose=False, timeline=True)
    fit(LinearModule(), [monitor], max_steps=1, default_root_dir=tmp_path)
    assert monitor.timeline_path == str(tmp_path / "memkit_timeline.png")
    assert (tmp_path / "memkit_timeline.png").is_file()


@pytest.mark.parametrize("timeline", [1, None, ""])
def test_bad_timeline(timeline):
    with pytest.raises(TypeError, match=r"PeakMemoryMonitor\(timeline=.*must be a bool or a file path"):
        PeakMemoryMonitor(timeline=timeline)


@pytest.mark.cuda
def test_cuda_timeline_is_a_memory_snapshot(tmp_path):
    import pickle

    path = tmp_path / "snapshot.pickle"
    monitor = PeakMemoryMonitor(device="cuda", verbose=False, timeline=str(path))
    trainer = L.Trainer(accelerator="cuda", devices=1, max_steps=2, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, logger=False, callbacks=[monitor])
    trainer.fit(LinearModule())
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert "segments" in snapshot and "device_traces" in snapshot
    assert monitor.timeline_path == str(path)
