"""Step each parameter in backward, as soon as its gradient is complete, and free the gradient: the gradients of the
whole model are never alive at once.

Example::

    from lightning import Trainer
    from lightning_memkit.callbacks import OptimizerInBackward

    # the optimizer configure_optimizers returns (AdamW, SGD, ...) steps inside backward; the same losses
    trainer = Trainer(callbacks=[OptimizerInBackward()])

YAML (LightningCLI)::

    trainer:
      callbacks:
        - class_path: lightning_memkit.callbacks.OptimizerInBackward
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_memkit.callbacks.optimizer_lever import OptimizerLever, clipping_refusal
from lightning_memkit.optim.in_backward import InBackwardOptimizer

__all__ = ["OptimizerInBackward"]


class OptimizerInBackward(OptimizerLever):
    """The configured optimizer, split per parameter and stepped in backward
    (:class:`~lightning_memkit.optim.in_backward.InBackwardOptimizer`): the device holds one parameter's gradient at a
    time instead of all of them. The math is the configured optimizer's (bitwise on CPU); LR schedulers work as
    before; checkpoints keep the configured optimizer's format (a run resumes with or without the callback).

    The Trainer's optimizer is replaced from ``on_fit_start`` to ``teardown``; its ``step()`` runs Lightning's closure
    (forward and backward, where the steps happen). ``on_before_optimizer_step`` and ``on_after_backward`` hooks see
    no gradients.

    Refused (one-line ``ValueError``, before anything changes): manual optimization, ``accumulate_grad_batches > 1``,
    gradient clipping (``gradient_clip_val`` or an own ``configure_gradient_clipping``), a precision plugin with a
    gradient scaler (``"16-mixed"``), more than one optimizer, a strategy other than a single device (DDP reduces
    the gradients after backward), an optimizer it cannot split per parameter (LBFGS, or a class other than torch's
    SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, ASGD, NAdam, RAdam, RMSprop, Rprop, Adafactor).
    """

    owner = "OptimizerInBackward"
    strategies = (SingleDeviceStrategy,)

    def wrap(self, optimizer: torch.optim.Optimizer) -> InBackwardOptimizer:
        return InBackwardOptimizer(optimizer)

    def refusals(self, trainer: Trainer, pl_module: LightningModule) -> list[str | None]:
        return [
            None if pl_module.automatic_optimization else
            f"it needs automatic optimization; {type(pl_module).__name__} sets automatic_optimization=False",
            None if trainer.accumulate_grad_batches == 1 else
            f"accumulate_grad_batches={trainer.accumulate_grad_batches}: each backward steps the parameters at once",
            clipping_refusal(trainer, pl_module, "are stepped and freed in backward"),
            None if getattr(trainer.precision_plugin, "scaler", None) is None else
            "the precision plugin scales the gradients (16-mixed): they would be stepped before being unscaled",
        ]
