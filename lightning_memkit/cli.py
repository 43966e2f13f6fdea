"""The ``memkit`` command: Lightning's CLI with a memory report at the end of ``fit``.

``memkit`` is :class:`lightning.pytorch.cli.LightningCLI` with any LightningModule / LightningDataModule
selectable by ``class_path`` (default: :class:`~lightning_memkit.demo.TinyLM` on
:class:`~lightning_memkit.demo.ByteTextDataModule`). After ``fit`` it prints, on global rank 0, one report
built from the callbacks found on the trainer: the :class:`~lightning_memkit.callbacks.PeakMemoryMonitor`
summary, the latest ``SavedTensorProfiler`` table with the paths of its JSON/PNG files, and the first
and last training loss.

Usage::

    memkit fit --config examples/configs/tiny_lm.yaml
    memkit fit --config examples/configs/tiny_lm.yaml --trainer.max_steps 20 --model.n_layers 2
    memkit fit --help
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from lightning_memkit.callbacks.peak_memory_monitor import PeakMemoryMonitor
from lightning_memkit.validation import check_int

__all__ = ["MemkitCLI", "LossTracker", "memory_report", "main"]

DEFAULT_MODEL = "lightning_memkit.demo.TinyLM"
DEFAULT_DATA = "lightning_memkit.demo.ByteTextDataModule"


class LossTracker(Callback):
    """Keeps the first and the last training loss of a fit (``outputs["loss"]`` or a tensor output)."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self.steps = 0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.first = self.last = None
        self.steps = 0

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        value = float(loss.detach())
        if math.isfinite(value):
            if self.first is None:
                self.first = value
            self.last = value
            self.steps += 1


def _saved_tensor_profiler_type() -> type | None:
    """The ``SavedTensorProfiler`` class, or ``None`` where it cannot be imported."""
    try:
        from lightning_memkit.callbacks.saved_tensor_profiler import SavedTensorProfiler
    except Exception:  # an optional part of the report: never stop the CLI over it
        return None
    return SavedTensorProfiler


def memory_report(trainer: Trainer) -> list[Any]:
    """Renderables (rich tables and strings) describing the memory of the last fit of ``trainer``."""
    parts: list[Any] = []
    monitors = [cb for cb in trainer.callbacks if isinstance(cb, PeakMemoryMonitor)]
    for monitor in monitors:
        parts.append(monitor.table())
    profiler_type = _saved_tensor_profiler_type()
    profilers = [cb for cb in trainer.callbacks if profiler_type is not None and isinstance(cb, profiler_type)]
    for profiler in profilers:
        report = getattr(profiler, "last_report", None)
        if report is None:
            parts.append("SavedTensorProfiler: no step was profiled.")
            continue
        parts.append(str(report))
        written = [str(p) for p in getattr(profiler, "written", [])]
        if written:
            parts.append("Saved-tensor report written to:\n" + "\n".join(f"  {p}" for p in written))
    if not monitors and not profilers:
        parts.append("No memkit memory callback ran: add PeakMemoryMonitor or SavedTensorProfiler to the callbacks.")
    for tracker in (cb for cb in trainer.callbacks if isinstance(cb, LossTracker)):
        if tracker.first is not None:
            parts.append(
                f"train loss: first {tracker.first:.4f} -> last {tracker.last:.4f} over {tracker.steps} steps"
            )
    return parts


class MemkitCLI(LightningCLI):
    """``LightningCLI`` whose ``fit`` ends with :func:`memory_report` printed once, on global rank 0.

    So that the report is the one place the summary appears, ``PeakMemoryMonitor`` callbacks on the
    trainer are switched to ``verbose=False`` before ``fit``. One option is added to Lightning's:
    ``torch_num_threads`` (top level of the YAML, or ``--torch_num_threads``), applied with
    ``torch.set_num_threads`` for the run and restored afterwards.

    Example::

        from lightning_memkit.cli import MemkitCLI

        MemkitCLI(args=["fit", "--config", "examples/configs/tiny_lm.yaml", "--trainer.max_steps", "5"])
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        defaults = dict(kwargs.pop("trainer_defaults", None) or {})
        extra = defaults.get("callbacks", [])
        defaults["callbacks"] = [*(extra if isinstance(extra, list) else [extra]), LossTracker()]
        threads = torch.get_num_threads()
        try:
            super().__init__(*args, trainer_defaults=defaults, **kwargs)
        finally:
            torch.set_num_threads(threads)  # `torch_num_threads` applies to this run only

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--torch_num_threads", type=int | None, default=None,
            help="torch.set_num_threads for this run (default: leave PyTorch's choice). 1 is fastest on a CPU "
            "whose cores are busy with other work.",
        )
        parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}, "data": {"class_path": DEFAULT_DATA}})

    def before_instantiate_classes(self) -> None:
        threads = self._get(self.config, "torch_num_threads")
        if threads is None:
            return
        torch.set_num_threads(check_int(threads, "torch_num_threads", minimum=1, allow_none=True, owner="MemkitCLI"))

    def before_fit(self) -> None:
        for cb in self.trainer.callbacks:
            if isinstance(cb, PeakMemoryMonitor):
                cb.verbose = False

    def after_fit(self) -> None:
        if not self.trainer.is_global_zero:
            return
        from rich.console import Console
        from rich.rule import Rule

        console = Console()
        console.print(Rule("memkit memory report"))
        for part in memory_report(self.trainer):
            if isinstance(part, str):  # plain text (paths included) is printed as is, never wrapped
                console.print(part, markup=False, highlight=False, soft_wrap=True)
            else:
                console.print(part)


def main(args: ArgsType = None) -> None:
    """Entry point of the ``memkit`` console script; ``args`` as for ``LightningCLI`` (default: ``sys.argv``)."""
    MemkitCLI(args=args)


if __name__ == "__main__":
    main()
