"""The ``optimizer_in_backward`` lever: each parameter stepped as soon as its gradient is complete and the gradient
freed (:class:`~lightning_memkit.callbacks.OptimizerInBackward`): no full gradient buffer; the same math. Off with
gradient accumulation (micro-batches included), clipping, or an optimizer it cannot split per parameter.

    >>> from lightning_memkit.estimate.levers.optimizer_in_backward import OPTIMIZER_IN_BACKWARD
    >>> OPTIMIZER_IN_BACKWARD.takes("AdamW"), OPTIMIZER_IN_BACKWARD.takes("LBFGS")
    (True, False)
"""

from __future__ import annotations

from typing import Any

from lightning_memkit.estimate.levers.base import StepSpec, TrainerEdit, Written
from lightning_memkit.estimate.levers.optimizer_state import OptimizerStateLever

__all__ = ["OPTIMIZER_IN_BACKWARD", "OptimizerInBackwardLever"]


class OptimizerInBackwardLever(OptimizerStateLever):
    name, kind, keeps_math, refuses_accumulation = "optimizer_in_backward", "free", True, True
    callback = "lightning_memkit.callbacks.OptimizerInBackward"
    label = "optimizer step in backward"
    reorders_only = True  # each parameter's step as soon as its gradient is complete: the same ops

    def wrap(self, factory: Any) -> Any:
        from lightning_memkit.optim.in_backward import in_backward

        return in_backward(factory)

    def to_step(self, choice: Any, spec: StepSpec) -> None:
        spec.steps_in_backward = bool(choice)
        super().to_step(choice, spec)

    def carried_by_offload(self, plan: Any) -> bool:
        """Whether the host offload carries this lever too (``OffloadOptimizer(offload_gradients=True)``)."""
        return bool(plan.get("offload_optimizer"))

    def write_hf(self, plan: Any, run: Any, out: Written) -> None:
        if not self.carried_by_offload(plan):
            super().write_hf(plan, run, out)

    write_config = write_hf

    def write_module(self, plan: Any, run: Any, out: Written) -> None:
        if not self.carried_by_offload(plan):
            super().write_module(plan, run, out)

    def apply(self, choice: Any, base: Any, edit: TrainerEdit) -> None:
        if not self.carried_by_offload(edit.plan or {}):
            super().apply(choice, base, edit)


OPTIMIZER_IN_BACKWARD = OptimizerInBackwardLever()
