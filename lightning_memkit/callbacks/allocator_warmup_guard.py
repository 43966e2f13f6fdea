"""Lightning callback: keep transformers' allocator warmup from failing on small or capped GPUs.

Active from ``setup`` through ``configure_model`` (where a LightningModule loads pretrained weights) and
released when the run starts (``on_fit_start`` / ``on_{validation,test,predict}_start``), on ``teardown``
and on exceptions. The decision itself is :func:`lightning_memkit.memory.warmup_decision`.
"""

from __future__ import annotations

import logging

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_memkit.loading.allocator_warmup import (
    DEFAULT_MARGIN,
    DEFAULT_TARGET,
    DEFAULT_THRESHOLD,
    WarmupDecision,
    guard_allocator_warmup,
)

__all__ = ["AllocatorWarmupGuard"]

log = logging.getLogger("lightning_memkit")


class AllocatorWarmupGuard(Callback):
    """Skip or cap ``caching_allocator_warmup`` while the model is set up and its weights load.

    Args:
        mode: ``on``, ``off``, ``auto`` (skip below ``threshold_bytes`` of effective memory) or ``cap`` (run
            with the block capped to free memory minus ``margin_bytes``); ``None`` reads
            ``MEMKIT_ALLOCATOR_WARMUP`` (default ``auto``).
        threshold_bytes: ``auto`` skips the warmup when total memory x per-process fraction is below this.
        margin_bytes: ``cap`` leaves this much of the free memory untouched.
        target: the warmup function, as ``module.function``.

    Example::

        class Model(LightningModule):
            def configure_model(self):
                self.model = AutoModelForCausalLM.from_pretrained(path, device_map=self.device)

        Trainer(callbacks=[AllocatorWarmupGuard(mode="auto")]).fit(Model())

    or in LightningCLI YAML::

        trainer:
          callbacks:
            - class_path: lightning_memkit.callbacks.AllocatorWarmupGuard
              init_args: {mode: cap, margin_bytes: 2147483648}
    """

    def __init__(
        self,
        mode: str | None = None,
        threshold_bytes: int = DEFAULT_THRESHOLD,
        margin_bytes: int = DEFAULT_MARGIN,
        target: str = DEFAULT_TARGET,
    ):
        self._guard = guard_allocator_warmup(
            target=target, mode=mode, threshold_bytes=threshold_bytes, margin_bytes=margin_bytes
        )
        self._logged = False

    @property
    def decision(self) -> WarmupDecision | None:
        """The decision taken at the last ``setup`` (``None`` before)."""
        return self._guard.decision

    @property
    def calls(self) -> list[WarmupDecision]:
        """One decision per call of the warmup function while the guard was active."""
        return self._guard.calls

    @property
    def active(self) -> bool:
        return self._guard.active

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._guard.activate()
        if not self._logged and trainer.is_global_zero:
            self._logged = True
            log.info("AllocatorWarmupGuard: %s", self._guard.decision.reason)

    def memory_effect(self) -> str:
        """One line: the warmup decision and how many warmup calls it applied to."""
        decision = self.decision
        if decision is None:
            return "AllocatorWarmupGuard: not active (no setup ran)"
        calls = len(self.calls)
        return f"AllocatorWarmupGuard: {decision.reason}; {calls} warmup call{'' if calls == 1 else 's'} during setup"

    def _release(self) -> None:
        self._guard.release()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release()

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release()

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._release()
