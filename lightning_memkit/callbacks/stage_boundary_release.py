"""Free the storage of marked stage-boundary tensors during training steps.

``StageBoundaryRelease`` opens a :func:`~lightning_memkit.memory.release_stage_boundaries` block at
``on_train_batch_start`` and closes it at ``on_train_batch_end`` (or on an exception), so the
:func:`~lightning_memkit.release.stage_boundary` marks in the model act during the forward and backward
of each training step and nowhere else (validation, prediction and the model's use outside the Trainer
are unchanged). Under ``FSDPStrategy`` and ``ModelParallelStrategy`` (``fully_shard``) it runs unchanged:
the marked tensors are activations of each rank's own forward, and the bytes counted are that rank's.

Example::

    from lightning.pytorch import Trainer
    from lightning_memkit.callbacks import StageBoundaryRelease
    from lightning_memkit.demo import ByteTextDataModule, TinyMoE

    release = StageBoundaryRelease()
    Trainer(max_steps=20, callbacks=[release]).fit(TinyMoE(exchange="copy"), ByteTextDataModule())
    release.released_bytes        # bytes freed early over the run

LightningCLI YAML::

    trainer:
      callbacks:
        - class_path: lightning_memkit.callbacks.StageBoundaryRelease
          init_args: {enabled: true, check: true}
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lightning_memkit.release.stage_boundary import BoundaryStats, release_stage_boundaries

__all__ = ["StageBoundaryRelease"]


class StageBoundaryRelease(Callback):
    """Act on ``stage_boundary`` marks inside each training step.

    Args:
        enabled: switch the release on (``False`` leaves every mark a no-op).
        check: run the safety check of ``release_storage`` on each release (refused releases raise,
            or are kept where the model marked them with ``on_refuse="keep"``).
        poison: poison instead of freeing and raise on a later read (default: ``MEMKIT_POISON``).

    Attributes:
        released_bytes: bytes released over all steps.
        released: tensors released over all steps.
        kept: releases refused and kept (``on_refuse="keep"``) over all steps.
        last_stats: the :class:`~lightning_memkit.memory.BoundaryStats` of the latest step.
    """

    def __init__(self, enabled: bool = True, check: bool = True, poison: bool | None = None):
        for name, value in (("enabled", enabled), ("check", check)):
            if not isinstance(value, bool):
                raise TypeError(f"StageBoundaryRelease({name}=...) must be a bool, got {type(value).__name__}")
        if poison is not None and not isinstance(poison, bool):
            raise TypeError(f"StageBoundaryRelease(poison=...) must be None or a bool, got {type(poison).__name__}")
        self.enabled = enabled
        self.check = check
        self.poison = poison
        self.released_bytes = 0
        self.released = 0
        self.kept = 0
        self.last_stats: BoundaryStats | None = None
        self._stack: ExitStack | None = None
        self._warned_unmarked = False

    def memory_effect(self) -> str:
        """One line: tensors and bytes freed early over all steps, and releases refused and kept."""
        if not self.enabled:
            return "StageBoundaryRelease: disabled (enabled=False)"
        if not self.released and not self.kept:
            return "StageBoundaryRelease: no stage_boundary release ran (no marked tensor in the training steps)"
        kept = f"; {self.kept} refused and kept" if self.kept else ""
        return (f"StageBoundaryRelease: {self.released_bytes:,} bytes freed early ({self.released} tensors released "
                f"before their layer's backward, over all steps){kept}")

    def _close(self) -> None:
        if self._stack is None:
            return
        stack, self._stack = self._stack, None
        stack.close()
        stats = self.last_stats
        if stats is not None:
            self.released_bytes += stats.released_bytes
            self.released += stats.released
            self.kept += len(stats.kept)

    def _warn_if_unmarked(self, stats: BoundaryStats) -> None:
        if stats.marks or self._warned_unmarked:
            return
        self._warned_unmarked = True
        rank_zero_warn(
            "StageBoundaryRelease: no stage_boundary() mark ran during the training step, so nothing is released. "
            "It frees only tensors the model marks with lightning_memkit.release.stage_boundary (Hugging Face "
            "models have no marks); remove the callback or mark the model's stage outputs."
        )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._close()
        if not self.enabled:
            return
        stack = ExitStack()
        self.last_stats = stack.enter_context(release_stage_boundaries(check=self.check, poison=self.poison))
        self._stack = stack

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        open_block = self._stack is not None
        self._close()
        if open_block and self.last_stats is not None:
            self._warn_if_unmarked(self.last_stats)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close()
