"""A callback whose changes to the model live for one fit: undone at the fit's teardown and on an exception.

Example::

    >>> class Patch(FitScopedCallback):
    ...     undone = 0
    ...     def _restore(self):
    ...         self.undone += 1
    >>> patch = Patch()
    >>> patch.on_exception(None, None, RuntimeError("boom"))
    >>> patch.teardown(None, None, "validate")  # another stage's teardown leaves the fit's changes alone
    >>> patch.undone
    1
"""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from lightning_memkit.callbacks.phase_memory_release import drop_model_log_refs

__all__ = ["FitScopedCallback"]


class FitScopedCallback(Callback):
    """Calls :meth:`_restore` at ``teardown`` of ``fit`` and on an exception (Lightning calls no callback's
    ``teardown`` when a run raises); drops the model's ``log`` references Lightning leaves on the callback."""

    def _restore(self) -> None:
        raise NotImplementedError

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._restore()
        drop_model_log_refs([self], pl_module)  # Lightning's callback.log would keep the model alive
