"""What the optimizer-state callbacks share: the Trainer's one optimizer replaced for the fit, after every refusal is
checked, and given back at its end.

:class:`OptimizerLever` is the base of :class:`~lightning_memkit.callbacks.OptimizerInBackward`,
:class:`~lightning_memkit.callbacks.OffloadOptimizer` and :class:`~lightning_memkit.callbacks.Optimizer8bit`. At
``on_fit_start`` (the optimizer is configured; a checkpoint's state is loaded after it, into the replacement) it
checks the subclass's refusals, then builds the replacement from the configured optimizer (which also refuses, before
anything changes) and makes it the Trainer's. LR schedulers keep the configured optimizer, whose parameter groups the
replacement reads. At ``teardown`` (or on an exception) the replacement's ``restore()``, if it has one, gives the
configured optimizer back with the state.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

__all__ = ["OptimizerLever", "clipping_refusal"]


def clipping_refusal(trainer: Trainer, pl_module: LightningModule, why: str) -> str | None:
    """Why gradient clipping cannot run (``why``: what took the gradients), or ``None`` when none is set."""
    if trainer.gradient_clip_val:
        return f"gradient clipping (gradient_clip_val={trainer.gradient_clip_val}) needs the gradients, which {why}"
    if type(pl_module).configure_gradient_clipping is not LightningModule.configure_gradient_clipping:
        return f"{type(pl_module).__name__} overrides configure_gradient_clipping; the gradients {why}"
    return None


class OptimizerLever(Callback):
    """Base: replaces the Trainer's optimizer by :meth:`wrap` of it for the fit (see the module doc).

    Subclasses set ``owner`` and ``strategies`` (the strategy classes they run under) and define :meth:`wrap` and,
    if they refuse more, :meth:`refusals`.

    Attributes:
        optimizer: the replacement while a fit runs, else ``None``.
    """

    owner = "OptimizerLever"
    strategies: tuple[type, ...] = (SingleDeviceStrategy, DDPStrategy)

    def __init__(self) -> None:
        self.optimizer: torch.optim.Optimizer | None = None

    def wrap(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The replacement of the configured ``optimizer`` (raising, before any change, if it cannot be one)."""
        raise NotImplementedError

    def refusals(self, trainer: Trainer, pl_module: LightningModule) -> list[str | None]:
        """Reasons this fit cannot use the lever (``None`` entries: no reason)."""
        return []

    @classmethod
    def trainer_refusals(cls, trainer: Trainer, pl_module: LightningModule) -> str | None:
        """The first reason the Trainer as set up refuses the lever, before its optimizer is configured (what
        ``MemoryBudget`` asks before it plans), or ``None``."""
        if not isinstance(trainer.strategy, cls.strategies):
            allowed = ", ".join(s.__name__ for s in cls.strategies)
            return f"it runs under {allowed}, not {type(trainer.strategy).__name__}"
        return next((r for r in cls().refusals(trainer, pl_module) if r), None)

    def _reasons(self, trainer: Trainer, pl_module: LightningModule) -> list[str]:
        count = len(trainer.strategy.optimizers)
        reasons = [f"it replaces one optimizer; configure_optimizers returned {count}" if count != 1 else None]
        if not isinstance(trainer.strategy, self.strategies):
            allowed = ", ".join(s.__name__ for s in self.strategies)
            reasons.append(f"it runs under {allowed}, not {type(trainer.strategy).__name__}")
        return [r for r in [*reasons, *self.refusals(trainer, pl_module)] if r]

    # -- hooks -----------------------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._give_back(trainer)
        reasons = self._reasons(trainer, pl_module)
        if reasons:
            raise ValueError(f"{self.owner}: {reasons[0]}")
        try:
            self.optimizer = self.wrap(trainer.strategy.optimizers[0])
        except (TypeError, ValueError) as error:  # the configured optimizer cannot have the lever: nothing changed
            raise ValueError(f"{self.owner}: {error}") from error
        trainer.strategy.optimizers = [self.optimizer]

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._give_back(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._give_back(trainer)

    def _give_back(self, trainer: Trainer) -> None:
        """Undo :meth:`on_fit_start`: the replacement's ``restore()`` (hooks off, state back in the configured
        optimizer), which becomes the Trainer's again. A replacement without ``restore`` stays (its state is the
        run's)."""
        wrapped, self.optimizer = self.optimizer, None
        restore: Any = getattr(wrapped, "restore", None)
        if wrapped is None or restore is None:
            return
        configured = restore()
        if trainer.strategy.optimizers and trainer.strategy.optimizers[0] is wrapped:
            trainer.strategy.optimizers = [configured]
