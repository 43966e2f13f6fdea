"""Measure the peak memory of every training step and log it, with a summary at the end of training.

Example::

    from lightning import Trainer
    from lightning_memkit.callbacks import PeakMemoryMonitor

    monitor = PeakMemoryMonitor(log_every_n_steps=10)
    trainer = Trainer(callbacks=[monitor])
    trainer.fit(model)
    monitor.summary["max_step_peak_bytes"]   # the largest step peak over all ranks, in bytes
    print(monitor.static_table)              # parameter, gradient and optimizer bytes per module
    monitor.effects                          # one line per active memkit feature
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torchmetrics import MaxMetric, MeanMetric

from lightning_memkit.common.validation import check_int
from lightning_memkit.measure.allocator_peak import AllocatorPeak
from lightning_memkit.measure.compiled import compiled_parts
from lightning_memkit.measure.device import resolve_device
from lightning_memkit.measure.live_peak import LivePeak
from lightning_memkit.measure.report import StaticMemoryTable, memory_effects, render_text, static_memory_table
from lightning_memkit.measure.storage import format_bytes

__all__ = ["PeakMemoryMonitor"]

log = logging.getLogger(__name__)


class PeakMemoryMonitor(Callback):
    """Peak memory of each training step (``on_train_batch_start`` to ``on_train_batch_end``), in bytes.

    What one step's peak is:

    * CUDA: ``torch.cuda.reset_peak_memory_stats`` at batch start, then ``max_memory_allocated`` at batch
      end. ``memkit/step_peak_bytes`` is the peak minus the bytes allocated when the step started (what
      the step itself added: activations, gradients, optimizer temporaries);
      ``memkit/step_peak_allocated_bytes`` is the absolute peak (weights and optimizer state included).
      Every step is measured; the cost is two counter reads.
    * CPU (and other devices): a :class:`~lightning_memkit.memory.LivePeak` around the step, exact to the
      byte for storages created during the step. Its dispatch mode costs Python time per op, so only
      every ``cpu_sample_every_n_steps``-th batch is measured (batches 0, n, 2n, ...); the others cost
      one integer test. Set it to 1 to measure every step.

    ``torch.compile``: measuring never leaves a model uncompiled. On CUDA the allocator's counters see
    compiled code as any other. On CPU, when the model runs compiled code (a compiled LightningModule
    passed to ``Trainer.fit``, ``torch.compile(submodule)`` or ``submodule.compile()``, found at train start
    by :func:`~lightning_memkit.measure.compiled.runs_compiled`), the sampled steps are counted by the CPU
    allocator instead (:class:`~lightning_memkit.measure.allocator_peak.AllocatorPeak`, ``torch.profiler``'s
    memory events), because inductor's kernels allocate their buffers where LivePeak's dispatch mode
    cannot see them; ``summary["method"]`` says ``"AllocatorPeak"`` and one info line says why. That
    count needs the profiler to itself: a step during which another profiler session runs, or a planning
    run (``ActivationCheckpointing(budget_bytes=...)``) measures with its own, is not recorded (one
    warning). On other devices a compiled model's steps are not recorded (one warning); no CPU timeline
    is drawn for a compiled model (one warning).

    Step peaks are aggregated with torchmetrics (``MaxMetric``, ``MeanMetric``, synced over ranks at
    epoch and training end). Measured steps are written to every logger every ``log_every_n_steps``-th
    measured step; ``memkit/peak_bytes`` (the largest step peak so far, all ranks) at each epoch end.
    At the end of training ``summary`` holds a dict and, on global rank 0 with ``verbose``, a table is
    printed.

    Around that: at fit start, ``static_table`` holds :func:`~lightning_memkit.measure.report.static_memory_table`
    of the LightningModule with the trainer's optimizers (parameter, gradient and optimizer-state bytes
    per top-level module), printed on global rank 0 with ``verbose``; at the end of training ``effects``
    holds one line per active memkit feature (:func:`~lightning_memkit.measure.report.memory_effects`), printed
    after the table. Planning runs of other features (``ActivationCheckpointing``'s budget probes) are
    excluded from the step peak.

    ``timeline`` records one step in detail: the first measured step, on global rank 0. On CPU a PNG of
    the live bytes after every allocation and free of the step (``LivePeak``'s count), with backward and
    the optimizer step marked; on CUDA a ``torch.cuda.memory`` snapshot (a pickle that
    https://pytorch.org/memory_viz opens). ``True`` writes ``memkit_timeline.png`` (CPU) or
    ``memkit_memory_snapshot.pickle`` (CUDA) in the trainer's ``default_root_dir``; a path writes there.

    Args:
        log_every_n_steps: write every n-th measured step peak to the loggers.
        device: the device to measure (``None``: the LightningModule's device). Accepts what
            :func:`~lightning_memkit.memory.resolve_device` accepts.
        cpu_sample_every_n_steps: on non-CUDA devices, measure one batch in this many (default 10).
        verbose: print the static table at fit start and the summary and feature lines at the end of training.
        timeline: ``False``, ``True`` or a file path: record the first measured step (see above).
    """

    def __init__(
        self,
        log_every_n_steps: int = 1,
        device: torch.device | str | int | None = None,
        cpu_sample_every_n_steps: int = 10,
        verbose: bool = True,
        timeline: bool | str | os.PathLike = False,
    ):
        self.log_every_n_steps = check_int(log_every_n_steps, "log_every_n_steps", minimum=1, owner="PeakMemoryMonitor")
        self.cpu_sample_every_n_steps = check_int(
            cpu_sample_every_n_steps, "cpu_sample_every_n_steps", minimum=1, owner="PeakMemoryMonitor"
        )
        if not isinstance(verbose, bool):
            raise TypeError(f"PeakMemoryMonitor(verbose=...) must be a bool, got {type(verbose).__name__}")
        if not isinstance(timeline, (bool, str, os.PathLike)) or timeline == "":
            raise TypeError(f"PeakMemoryMonitor(timeline={timeline!r}): must be a bool or a file path")
        self._requested_device = resolve_device(device) if device is not None else None
        if self._requested_device is not None and self._requested_device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"PeakMemoryMonitor(device={device!r}): CUDA is not available; use 'cpu' or None")
        self.verbose = verbose
        self.timeline = timeline
        self.timeline_path: str | None = None  # the file written by the last fit, if any
        self.static_table: StaticMemoryTable | None = None
        self.effects: list[str] = []
        self._timeline = _Timeline(None)
        self.device: torch.device | None = self._requested_device
        self.summary: dict[str, Any] = {}
        self.last_step_peak: int | None = None
        self.last_step_peak_allocated: int | None = None
        self._max = MaxMetric()
        self._mean = MeanMetric()
        self._max_allocated = MaxMetric()
        for m in (self._max, self._mean, self._max_allocated):
            m.set_dtype(torch.float64)  # byte counts stay exact up to 2**53
        self._pending = _no_pending()
        self._tracker: LivePeak | None = None
        self._counter: AllocatorPeak | None = None
        self._compiled: list[str] = []  # compiled parts found at train start (CPU and other devices)
        self._cuda_start: int | None = None
        self._batches = 0
        self._measured = 0
        self._warned_nesting = False
        self._warned: set[str] = set()

    # -- lifecycle ---------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # the module is moved to its device after this hook: ask the strategy where it goes
        self.device = self._requested_device or resolve_device(trainer.strategy.root_device)
        metric_device = self.device if self.device.type == "cuda" else torch.device("cpu")
        for m in (self._max, self._mean, self._max_allocated):
            m.reset()
            m.to(metric_device)
            m.set_dtype(torch.float64)  # after .to(), which does not keep it
        self._pending = _no_pending()
        self.summary = {}
        self.effects = []
        self.static_table = None
        self.last_step_peak = self.last_step_peak_allocated = None
        self._batches = self._measured = 0
        self._compiled = []
        self._timeline = _Timeline(self._timeline_target(trainer))
        self.timeline_path = None

    def _timeline_target(self, trainer: Trainer) -> str | None:
        if self.timeline is False or not trainer.is_global_zero:
            return None
        if self.timeline is True:
            name = "memkit_memory_snapshot.pickle" if self.uses_cuda_counters else "memkit_timeline.png"
            return os.path.join(trainer.default_root_dir, name)
        return os.fspath(self.timeline)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.static_table = static_memory_table(pl_module, trainer.optimizers)
        if self.verbose and trainer.is_global_zero:
            from rich.console import Console

            Console().print(self.static_table.table())

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # after configure_model and the strategy's wrapping: the model as it will run
        self._compiled = [] if self.uses_cuda_counters else compiled_parts(pl_module)
        if not self._compiled:
            return
        parts = ", ".join(name or type(pl_module).__name__ for name in self._compiled[:3])
        parts += ", ..." if len(self._compiled) > 3 else ""
        if self.counts_with_allocator:
            log.info(
                "PeakMemoryMonitor: %s runs compiled; inductor's kernels allocate outside LivePeak's view, so the "
                "CPU allocator counts the sampled steps (AllocatorPeak, torch.profiler memory events)", parts
            )
        else:
            self._warn_once(
                "device", f"PeakMemoryMonitor: {parts} runs compiled on {self.device}, where neither LivePeak (blind "
                "to inductor's buffers) nor the allocator counters can count the step; steps are not recorded"
            )
        if self._timeline.path is not None and self._timeline._state == "idle":
            self._timeline.stop()
            self._warn_once(
                "timeline", "PeakMemoryMonitor(timeline=...): the CPU timeline is drawn from LivePeak's count, "
                f"which does not see inside {parts}'s compiled code; no timeline is written"
            )

    @property
    def counts_with_allocator(self) -> bool:
        """Whether CPU steps are counted by the allocator (a compiled model on CPU) rather than by ``LivePeak``."""
        return bool(self._compiled) and self.device is not None and self.device.type == "cpu"

    @property
    def uses_cuda_counters(self) -> bool:
        """Whether steps are measured with the CUDA allocator's counters (else with ``LivePeak``)."""
        return self.device is not None and self.device.type == "cuda"

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._close_tracker()  # a step skipped by `on_train_batch_start` returning -1 never reached batch end
        index, self._batches = self._batches, self._batches + 1
        if self.uses_cuda_counters:
            self._timeline.start_cuda()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_start = torch.cuda.memory_allocated(self.device)
            return
        if index % self.cpu_sample_every_n_steps:
            return
        if self._compiled:
            self._start_counter()
            return
        tracker = LivePeak()
        self._timeline.start_cpu(tracker, str(self.device))
        tracker.__enter__()
        self._tracker = tracker

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._timeline.mark("backward")

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._timeline.mark("optimizer step")

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.uses_cuda_counters:
            if self._cuda_start is None:
                return
            allocated = torch.cuda.max_memory_allocated(self.device)
            self._record(trainer, allocated - self._cuda_start, allocated)
            self._cuda_start = None
            self.timeline_path = self._timeline.finish() or self.timeline_path
            return
        counter = self._counter
        if counter is not None:
            if self._close_tracker():
                self._record(trainer, counter.peak_bytes, None)
            return
        tracker = self._tracker
        if tracker is None:
            return
        if self._close_tracker():
            self._record(trainer, self._device_peak(tracker), None)
            self.timeline_path = self._timeline.finish() or self.timeline_path

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_tracker()
        peak, _, allocated = self._compute()
        metrics = {}
        if peak is not None:
            metrics["memkit/peak_bytes"] = peak
        if allocated is not None:
            metrics["memkit/peak_allocated_bytes"] = allocated
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=_log_step(trainer))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_tracker()
        peak, mean, allocated = self._compute()
        self.summary = {
            "device": str(self.device),
            "method": self._method(),
            "measured_steps": self._measured,
            "sample_every_n_steps": 1 if self.uses_cuda_counters else self.cpu_sample_every_n_steps,
            "max_step_peak_bytes": None if peak is None else int(peak),
            "mean_step_peak_bytes": None if mean is None else float(mean),
            "max_step_peak_allocated_bytes": None if allocated is None else int(allocated),
        }
        self.effects = memory_effects(trainer)
        if self.verbose and trainer.is_global_zero:
            from rich.console import Console

            console = Console()
            console.print(self.table())
            for line in self.effects:
                console.print(line, markup=False, highlight=False)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close_tracker()
        self._timeline.stop()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close_tracker()
        self._timeline.stop()

    # -- report ------------------------------------------------------------------------------------
    def table(self, title: str = "Peak memory per training step"):
        """The summary as a ``rich.table.Table`` (empty before training ends)."""
        from rich.table import Table

        s = self.summary
        table = Table(title=title, title_justify="left")
        table.add_column("quantity")
        table.add_column("value", justify="right")
        if not s:
            table.add_row("status", "no training finished yet")
            return table
        table.add_row("device", f"{s['device']} ({s['method']})")
        every = s["sample_every_n_steps"]
        sampled = f" (1 in {every})" if every > 1 else ""
        table.add_row("measured steps (this rank)", f"{s['measured_steps']}{sampled}")
        table.add_row("max step peak (all ranks)", format_bytes(s["max_step_peak_bytes"], grouping=True))
        table.add_row("mean step peak (all ranks)", format_bytes(s["mean_step_peak_bytes"], grouping=True))
        if s["max_step_peak_allocated_bytes"] is not None:
            peak_allocated = format_bytes(s["max_step_peak_allocated_bytes"], grouping=True)
            table.add_row("max allocated incl. weights", peak_allocated)
        return table

    def __str__(self) -> str:
        return render_text(self.table(), width=100)

    # -- internals ---------------------------------------------------------------------------------
    def _record(self, trainer: Trainer, step_peak: int, allocated: int | None) -> None:
        self.last_step_peak, self.last_step_peak_allocated = step_peak, allocated
        # Plain Python per step (no device tensors, no kernel launches); folded into the metrics by _compute.
        p = self._pending
        p["max"] = max(p["max"], step_peak)
        p["sum"] += step_peak
        p["count"] += 1
        if allocated is not None:
            p["max_allocated"] = max(p["max_allocated"], allocated)
        self._measured += 1
        if (self._measured - 1) % self.log_every_n_steps:
            return
        metrics = {"memkit/step_peak_bytes": float(step_peak)}
        if allocated is not None:
            metrics["memkit/step_peak_allocated_bytes"] = float(allocated)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=_log_step(trainer))

    def _compute(self) -> tuple[float | None, float | None, float | None]:
        """Max, mean and max-allocated over all ranks (collective: every rank must call it)."""

        p, self._pending = self._pending, _no_pending()
        if p["count"]:
            dev = self._max.device
            self._max.update(torch.tensor(float(p["max"]), dtype=torch.float64, device=dev))
            mean = torch.tensor(p["sum"] / p["count"], dtype=torch.float64, device=dev)
            self._mean.update(mean, weight=torch.tensor(float(p["count"]), dtype=torch.float64, device=dev))
            if p["max_allocated"] >= 0:
                self._max_allocated.update(torch.tensor(float(p["max_allocated"]), dtype=torch.float64, device=dev))

        def value(metric) -> float | None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "compute called before update" on a rank with no steps
                v = float(metric.compute())
            return v if v == v and v not in (float("inf"), float("-inf")) else None

        return value(self._max), value(self._mean), value(self._max_allocated)

    def _device_peak(self, tracker: LivePeak) -> int:
        dev = self.device
        if dev is None or dev.type == "cpu":
            return tracker.by_device["cpu"].peak if "cpu" in tracker.by_device else 0
        peaks = [
            d.peak
            for name, d in tracker.by_device.items()
            if torch.device(name).type == dev.type and (dev.index is None or torch.device(name).index == dev.index)
        ]
        return max(peaks, default=0)

    def _method(self) -> str:
        if self.uses_cuda_counters:
            return "torch.cuda.max_memory_allocated"
        return "AllocatorPeak" if self.counts_with_allocator else "LivePeak"

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def _start_counter(self) -> None:
        """A compiled model's sampled step on CPU: the allocator counts it, if the profiler is free."""
        if not self.counts_with_allocator:
            return
        if torch.autograd.profiler._is_profiler_enabled:
            self._warn_once(
                "profiler", "PeakMemoryMonitor: another torch.profiler session runs during a sampled step; the "
                "allocator count of a compiled model needs the profiler, so such steps are not recorded"
            )
            return
        self._counter = AllocatorPeak("cpu").__enter__()

    def _close_tracker(self) -> bool:
        """Leave the open tracker, if any; ``True`` when it counted the whole step (its peak can be used).

        ``LivePeak`` leaves its dispatch mode even when modes entered after it are still open (another
        callback's tracker closed in a later hook). If its mode is no longer on the stack, someone popped
        it before the step ended: the count missed part of the step and is dropped, with a warning.
        """
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
            if not counter.complete:
                self._warn_once(
                    "interrupted", "PeakMemoryMonitor: another AllocatorPeak (a planning run's own count) stopped the "
                    "profiler session of a sampled step of the compiled model; such steps are not recorded"
                )
            return counter.complete
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            return False
        tracker.on_change = None
        mode = tracker._mode
        whole = mode is not None and any(m is mode for m in _get_current_dispatch_mode_stack())
        tracker.__exit__(None, None, None)
        if not whole and not self._warned_nesting:
            self._warned_nesting = True
            log.warning(
                "PeakMemoryMonitor: the step's tracker was closed from outside before the step ended; such "
                "steps are not recorded."
            )
        return whole


class _Timeline:
    """One recorded step: LivePeak's live bytes per change on CPU (a PNG), the allocator history on CUDA."""

    def __init__(self, path: str | None):
        self.path = path
        self.samples: list[int] = []
        self.marks: list[tuple[int, str]] = []
        self._state = "idle" if path is not None else "done"  # idle -> cpu | cuda -> done

    def start_cpu(self, tracker: LivePeak, device: str) -> None:
        if self._state != "idle":
            return
        self._state, self.samples, self.marks = "cpu", [0], []

        def sample(dev: str, live: int) -> None:
            if dev == device:
                self.samples.append(live)

        tracker.on_change = sample

    def start_cuda(self) -> None:
        if self._state == "idle":
            self._state = "cuda"
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def mark(self, label: str) -> None:
        if self._state == "cpu":
            self.marks.append((len(self.samples) - 1, label))

    def finish(self) -> str | None:
        """Write the recorded step; the path written, or ``None`` when nothing was being recorded."""
        state, self._state = self._state, "done"
        if state == "cuda":
            torch.cuda.memory._dump_snapshot(self.path)
            torch.cuda.memory._record_memory_history(enabled=None)
        elif state == "cpu":
            _plot_timeline(self.path, self.samples, self.marks)
        else:
            return None
        log.info("PeakMemoryMonitor: memory timeline of one step written to %s", self.path)
        return self.path

    def stop(self) -> None:
        """Stop recording without writing (an exception, or a fit that ended before a measured step)."""
        if self._state == "cuda":
            torch.cuda.memory._record_memory_history(enabled=None)
        self._state = "done"


def _plot_timeline(path: str, samples: list[int], marks: list[tuple[int, str]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    try:
        ax.step(range(len(samples)), samples, where="post", label="live bytes")
        for x, label in marks:
            ax.axvline(x, color="gray", linestyle="--", linewidth=1)
            ax.annotate(label, (x, max(samples)), rotation=90, va="top", ha="right", fontsize=8)
        peak = max(samples)
        ax.set_title(f"Live tensor bytes during one training step (peak {peak:,} bytes, {format_bytes(peak)})")
        ax.set_xlabel("allocation / free event (forward from the left)")
        ax.set_ylabel("bytes created in the step and alive")
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fig.savefig(path, dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)


def _no_pending() -> dict:
    return {"max": 0, "sum": 0, "count": 0, "max_allocated": -1}


def _log_step(trainer: Trainer) -> int:
    loop = getattr(trainer, "fit_loop", None)
    epoch_loop = getattr(loop, "epoch_loop", None)
    return int(getattr(epoch_loop, "_batches_that_stepped", trainer.global_step))
