"""Keep the optimizer's state and step on the host: the device holds the parameters and, until the step, the
gradients; the state and a copy of each parameter live in host memory.

Example::

    from lightning import Trainer
    from lightning_memkit.callbacks import OffloadOptimizer

    # AdamW's two moments (8 bytes per parameter) leave the GPU; the same losses
    trainer = Trainer(callbacks=[OffloadOptimizer()])

YAML (LightningCLI)::

    trainer:
      callbacks:
        - class_path: lightning_memkit.callbacks.OffloadOptimizer
          init_args: {offload_gradients: false}
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule, Trainer

from lightning_memkit.callbacks.optimizer_lever import OptimizerLever, clipping_refusal
from lightning_memkit.common.validation import check_bool
from lightning_memkit.optim.host_offload import HostOffloadOptimizer

__all__ = ["OffloadOptimizer"]


class OffloadOptimizer(OptimizerLever):
    """The configured optimizer run on host copies of the parameters
    (:class:`~lightning_memkit.optim.host_offload.HostOffloadOptimizer`): its state never takes device memory. After
    backward (and clipping) each step copies the gradients to the host (freeing them on the device), steps there and
    copies the parameters back; on CUDA through pinned buffers on a side stream, which the next forward waits for.
    The math is the configured optimizer's (bitwise on CPU); LR schedulers work as before; checkpoints keep the
    configured optimizer's format (a run resumes with or without the callback).

    Args:
        offload_gradients: copy each gradient to the host as soon as it is complete (no full gradient buffer on the
            device either); refused with ``accumulate_grad_batches > 1``, gradient clipping, a gradient scaler
            (``"16-mixed"``) and several processes, which need the gradients on the device after backward.

    Refused (one-line ``ValueError``, before anything changes): more than one optimizer, a strategy other than a
    single device or DDP, an optimizer class other than torch's per-parameter ones (SGD, Adam, AdamW, ...).
    """

    owner = "OffloadOptimizer"

    def __init__(self, offload_gradients: bool = False) -> None:
        super().__init__()
        self.offload_gradients = check_bool(offload_gradients, "offload_gradients", owner=self.owner)

    def wrap(self, optimizer: torch.optim.Optimizer) -> HostOffloadOptimizer:
        return HostOffloadOptimizer(optimizer, offload_gradients=self.offload_gradients)

    def refusals(self, trainer: Trainer, pl_module: LightningModule) -> list[str | None]:
        if not self.offload_gradients:
            return []
        why = "offload_gradients=True moves to the host in backward"
        return [
            None if trainer.accumulate_grad_batches == 1 else
            f"accumulate_grad_batches={trainer.accumulate_grad_batches}: gradients cannot accumulate on the host "
            "(offload_gradients=True)",
            clipping_refusal(trainer, pl_module, why),
            None if getattr(trainer.precision_plugin, "scaler", None) is None else
            f"the precision plugin unscales the gradients after backward, which {why}",
            None if trainer.world_size == 1 else
            f"{trainer.world_size} processes reduce the gradients after backward, which {why}",
        ]
