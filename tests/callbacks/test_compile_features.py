"""The measuring callbacks on a ``torch.compile``d LightningModule: it stays compiled, counted or saying why not."""

import logging

import lightning as L
import pytest
import torch
from torch import nn
from torch._dynamo.backends.registry import lookup_backend

from lightning_memkit.callbacks import PeakMemoryMonitor, SavedTensorProfiler
from lightning_memkit.measure.allocator_peak import AllocatorPeak

MONITOR_LOG = "lightning_memkit.callbacks.peak_memory_monitor"


class Counting:
    """A dynamo backend (``inner`` compiles): counts the graphs compiled and the compiled calls run."""

    def __init__(self, inner="eager"):
        self.inner = inner
        self.graphs = self.calls = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        compiled = lookup_backend(self.inner)(gm, example_inputs)

        def run(*args):
            self.calls += 1
            return compiled(*args)

        return run


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 1)

    def forward(self, x):
        return self.b(nn.functional.gelu(self.a(x)))


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)  # 4 steps


class StepPeaks(L.Callback):
    """Per step: the allocator's count (``count=True``) or the monitor's last step peak; and the loss."""

    def __init__(self, monitor=None):
        self.monitor, self.peaks, self.losses = monitor, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.monitor is None:
            self.counter = AllocatorPeak("cpu").__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.monitor is None:
            self.counter.__exit__(None, None, None)
            self.peaks.append(self.counter.peak_bytes)
        else:
            self.peaks.append(self.monitor.last_step_peak)
        self.losses.append(float(outputs["loss"]))


class HoldsTheProfiler(L.Callback):
    """Opens a CPU AllocatorPeak after the monitor's (a planning run's own count) on the first batch, or keeps a
    foreign torch.profiler session open for the whole fit."""

    def __init__(self, foreign=False):
        self.foreign = foreign

    def on_train_start(self, trainer, pl_module):
        if self.foreign:
            self.session = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.session.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.foreign and batch_idx == 0:
            with AllocatorPeak("cpu"):
                torch.empty(10)

    def on_train_end(self, trainer, pl_module):
        if self.foreign:
            self.session.__exit__(None, None, None)


def fit(module, callbacks, **kwargs):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, enable_checkpointing=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kwargs)
    trainer.fit(module)
    return trainer


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(backend):
    module = Regression()
    module.net.compile(backend=backend)
    return module


def test_monitor_keeps_the_model_compiled_and_counts_its_steps_with_the_allocator(caplog):
    eager = StepPeaks()
    fit(Regression(), [eager])
    backend = Counting("eager")  # the same ops as eager: the same bytes
    monitor = PeakMemoryMonitor(cpu_sample_every_n_steps=1, verbose=False)
    compiled = StepPeaks(monitor)
    with caplog.at_level(logging.INFO, logger=MONITOR_LOG):
        fit(_compiled(backend), [monitor, compiled])
    assert backend.graphs == 1 and backend.calls == 4  # compiled in the first measured step, run in every step
    assert monitor.summary["method"] == "AllocatorPeak" and monitor.summary["measured_steps"] == 4
    assert caplog.text.count("PeakMemoryMonitor: net runs compiled") == 1
    # the compiled steps counted as the allocator counts the eager ones (what the compile keeps alive: a few bytes)
    assert compiled.peaks[1:] == eager.peaks[1:] and abs(compiled.peaks[0] - eager.peaks[0]) <= 64
    assert compiled.losses == eager.losses


def test_monitor_says_once_that_it_draws_no_timeline_of_a_compiled_model(tmp_path, caplog):
    monitor = PeakMemoryMonitor(cpu_sample_every_n_steps=1, verbose=False, timeline=tmp_path / "t.png")
    with caplog.at_level(logging.WARNING, logger=MONITOR_LOG):
        fit(_compiled("eager"), [monitor])
    assert caplog.text.count("no timeline is written") == 1
    assert monitor.timeline_path is None and not (tmp_path / "t.png").exists()
    assert monitor.summary["measured_steps"] == 4


@pytest.mark.parametrize("foreign", [False, True], ids=["planning-run", "foreign-profiler"])
def test_monitor_leaves_out_the_steps_it_cannot_count_and_says_so_once(foreign, caplog):
    monitor = PeakMemoryMonitor(cpu_sample_every_n_steps=1, verbose=False)
    with caplog.at_level(logging.WARNING, logger=MONITOR_LOG):
        fit(_compiled("eager"), [monitor, HoldsTheProfiler(foreign)])
    said = "another torch.profiler session runs" if foreign else "another AllocatorPeak (a planning run's own count)"
    assert caplog.text.count(said) == 1
    assert monitor.summary["measured_steps"] == (0 if foreign else 3)


def test_saved_tensor_profiler_profiles_eagerly_and_the_model_stays_compiled(tmp_path, caplog):
    eager = SavedTensorProfiler(every_n_steps=2, depth=None, output_dir=tmp_path / "eager")
    fit(Regression(), [eager])
    backend = Counting("eager")
    profiler = SavedTensorProfiler(every_n_steps=2, depth=None, output_dir=tmp_path / "compiled")
    with caplog.at_level(logging.INFO, logger="lightning_memkit.callbacks.saved_tensor_profiler"):
        fit(_compiled(backend), [profiler])
    assert caplog.text.count("profiled steps run it eagerly") == 1
    assert backend.graphs == 1 and backend.calls == 2  # steps 0 and 2 profiled eagerly, 1 and 3 compiled
    rows = [(r.name, r.activation_bytes, r.weight_bytes) for r in profiler.last_report.rows]
    assert rows == [(r.name, r.activation_bytes, r.weight_bytes) for r in eager.last_report.rows]
    assert {"net.a", "net.b"} <= {name for name, _, _ in rows}  # per layer, as eager
