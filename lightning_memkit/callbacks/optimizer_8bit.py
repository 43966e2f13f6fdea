"""Replace the configured Adam/AdamW by an 8-bit AdamW (bitsandbytes): about 2 bytes of state per parameter instead
of 8. It changes the numerics: opt in.

Example::

    from lightning import Trainer
    from lightning_memkit.callbacks import Optimizer8bit

    # the AdamW of configure_optimizers, with its lr, betas, eps, weight decay and groups, keeps 8-bit moments
    trainer = Trainer(callbacks=[Optimizer8bit()])

YAML (LightningCLI)::

    trainer:
      callbacks:
        - class_path: lightning_memkit.callbacks.Optimizer8bit
          init_args: {min_8bit_size: 4096}
"""

from __future__ import annotations

import torch

from lightning_memkit.callbacks.optimizer_lever import OptimizerLever
from lightning_memkit.common.validation import check_int
from lightning_memkit.optim.eight_bit import MIN_8BIT_SIZE, EightBitAdamW

__all__ = ["Optimizer8bit"]


class Optimizer8bit(OptimizerLever):
    """The configured ``torch.optim.AdamW`` (or ``Adam`` without L2 weight decay) replaced by bitsandbytes'
    ``AdamW8bit`` with its hyperparameters and groups (:class:`~lightning_memkit.optim.eight_bit.EightBitAdamW`),
    from ``on_fit_start`` on; LR schedulers work as before. The replacement stays the Trainer's after the fit (its
    state is the run's). Checkpoints hold the 8-bit state: they resume with this callback only.

    Args:
        min_8bit_size: parameters with fewer elements keep float32 moments (bitsandbytes' default 4096).

    Refused (``ValueError``, before anything changes): an optimizer other than Adam/AdamW, AMSGrad, ``maximize``,
    Adam's L2 weight decay, more than one optimizer, a strategy other than a single device or DDP.
    """

    owner = "Optimizer8bit"

    def __init__(self, min_8bit_size: int = MIN_8BIT_SIZE) -> None:
        super().__init__()
        self.min_8bit_size = check_int(min_8bit_size, "min_8bit_size", minimum=0, owner=self.owner)

    def wrap(self, optimizer: torch.optim.Optimizer) -> EightBitAdamW:
        return EightBitAdamW(optimizer, min_8bit_size=self.min_8bit_size)
