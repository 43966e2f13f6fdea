"""The ``optimizer_in_backward`` lever: each parameter stepped as soon as its gradient is complete and the gradient
freed (:class:`~lightning_memkit.callbacks.OptimizerInBackward`): no full gradient buffer; the same math. Off with
gradient accumulation (micro-batches included), clipping, or an optimizer it cannot split per parameter.

    >>> from lightning_memkit.estimate.levers.optimizer_in_backward import OPTIMIZER_IN_BACKWARD
    >>> OPTIMIZER_IN_BACKWARD.takes("AdamW"), OPTIMIZER_IN_BACKWARD.takes("LBFGS")
    (True, False)
"""

from __future__ import annotations

from typing import Any

from lightning_memkit.estimate.levers.optimizer_state import OptimizerStateLever

__all__ = ["OPTIMIZER_IN_BACKWARD", "OptimizerInBackwardLever"]


class OptimizerInBackwardLever(OptimizerStateLever):
    name, kind, keeps_math, frees_gradients = "optimizer_in_backward", "free", True, True
    callback = "lightning_memkit.callbacks.OptimizerInBackward"
    label = "optimizer step in backward"

    def wrap(self, factory: Any) -> Any:
        from lightning_memkit.optim.in_backward import in_backward

        return in_backward(factory)


OPTIMIZER_IN_BACKWARD = OptimizerInBackwardLever()
