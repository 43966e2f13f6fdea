"""Profile, on chosen training steps, which layers keep how many bytes alive for backward.

Example::

    from lightning import Trainer
    from lightning_memkit.callbacks import SavedTensorProfiler

    trainer = Trainer(callbacks=[SavedTensorProfiler(every_n_steps=500, depth=2)])
    trainer.fit(model)   # step 0, 500, 1000, ...: table printed, saved_tensors_step<N>.json/.png written
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from lightning_memkit.common.validation import check_int
from lightning_memkit.measure.compiled import runs_compiled
from lightning_memkit.measure.saved_tensors import SavedTensorRecorder, SavedTensorReport

__all__ = ["SavedTensorProfiler"]

log = logging.getLogger(__name__)


_OWNER = "SavedTensorProfiler"


class SavedTensorProfiler(Callback):
    """Per-layer report of the tensors autograd keeps for backward, taken on selected training steps.

    A step is profiled when ``global_step >= first_step`` and ``(global_step - first_step) % every_n_steps
    == 0`` (by default steps 0, 100, 200, ...), once per optimizer step. On such a step the LightningModule's
    forwards are recorded from ``on_train_batch_start`` to ``on_before_backward`` (saved tensors, ``ctx``
    stashes, bytes still alive after forward) and the forward + backward peak until ``on_after_backward``;
    the report is finished in ``on_train_batch_end``, where the ``training_step`` outputs are known. Other
    steps cost one integer test.

    On global rank 0 the profiler prints the table, writes ``saved_tensors_step<N>.json`` and
    ``saved_tensors_step<N>.png`` to ``output_dir`` (default: the logger's ``log_dir``, else
    ``trainer.default_root_dir``) and logs ``memkit/saved_activation_bytes`` and ``memkit/saved_weight_bytes``
    to every logger. ``last_report`` holds the latest :class:`SavedTensorReport`, ``written`` every path
    written. With manual optimization, the first backward of the step ends the recording.

    ``torch.compile``: a profiled step runs the model's compiled code eagerly (bytes per module need the eager
    forward; see :class:`~lightning_memkit.measure.saved_tensors.SavedTensorRecorder`), said once in an info
    line; the other steps run the compiled graph, which is neither recompiled nor left uncompiled.

    Args:
        every_n_steps: profile every this many optimizer steps (an int >= 1).
        depth: group rows by the first ``depth`` components of module names (``None``: full names).
        output_dir: where the JSON and PNG go.
        first_step: the first profiled ``global_step``.
        max_rows: rows shown in the printed table and in the chart (the largest ones; the JSON has all).
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        depth: int | None = 2,
        output_dir: str | Path | None = None,
        first_step: int = 0,
        max_rows: int = 30,
    ):
        self.every_n_steps = check_int(every_n_steps, "every_n_steps", minimum=1, owner=_OWNER)
        check_int(depth, "depth", minimum=1, allow_none=True, owner=_OWNER)  # None: full module names
        if output_dir is not None and not isinstance(output_dir, (str, Path)):
            raise TypeError(f"output_dir must be a str, a pathlib.Path or None, got {type(output_dir).__name__}")
        self.depth = depth
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.first_step = check_int(first_step, "first_step", minimum=0, owner=_OWNER)
        self.max_rows = check_int(max_rows, "max_rows", minimum=1, owner=_OWNER)
        self.last_report: SavedTensorReport | None = None
        self.written: list[Path] = []
        self._recorder: SavedTensorRecorder | None = None
        self._loss: torch.Tensor | None = None
        self._step = -1
        self._last_step = -1

    def should_profile(self, global_step: int) -> bool:
        """Whether the step ``global_step`` is one this profiler records."""
        return global_step >= self.first_step and (global_step - self.first_step) % self.every_n_steps == 0

    # -- hooks -------------------------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_step = -1  # a new fit may start again from the same global_step
        if runs_compiled(pl_module):
            log.info("SavedTensorProfiler: the model runs compiled code; profiled steps run it eagerly (bytes per "
                     "module need the eager forward), the others compiled")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step or not self.should_profile(step):
            return
        self._close()
        self._last_step = self._step = step
        recorder = SavedTensorRecorder(pl_module, depth=self.depth)
        recorder.__enter__()
        self._recorder = recorder

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self._recorder is not None and self._loss is None:
            self._recorder.stop()
            self._loss = loss.detach()

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._recorder is not None:
            self._recorder.__exit__(None, None, None)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        recorder = self._recorder
        if recorder is None:
            return
        try:
            recorder.__exit__(None, None, None)
            report = recorder.report(output=(self._loss, outputs), include_peak=self._loss is not None)
        finally:
            self._recorder, self._loss = None, None
        self.last_report = report
        if trainer.is_global_zero:
            self._publish(trainer, report, self._step)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        recorder, self._recorder, self._loss = self._recorder, None, None
        if recorder is not None:
            recorder.__exit__(RuntimeError, RuntimeError("profiled step did not finish"), None)

    # -- output (rank 0) ---------------------------------------------------------------------------
    def _publish(self, trainer: Trainer, report: SavedTensorReport, step: int) -> None:
        from rich.console import Console

        Console().print(report.table(max_rows=self.max_rows, title=f"Saved tensors, step {step}"))
        out_dir = self._resolve_dir(trainer)
        stem = out_dir / f"saved_tensors_step{step}"
        self.written.append(report.save_json(stem.with_suffix(".json"), step=step))
        try:
            self.written.append(report.plot(stem.with_suffix(".png"), max_rows=self.max_rows,
                                            title=f"Saved tensors per module, step {step}"))
        except Exception as err:  # a chart must never stop training
            log.warning("SavedTensorProfiler: could not draw the chart: %s", err)
        metrics = {
            "memkit/saved_activation_bytes": float(report.total_activation_bytes),
            "memkit/saved_weight_bytes": float(report.total_weight_bytes),
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _resolve_dir(self, trainer: Trainer) -> Path:
        if self.output_dir is not None:
            return self.output_dir
        log_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
        return Path(log_dir) if log_dir else Path(trainer.default_root_dir)

