"""The ``offload_optimizer`` lever: the optimizer state and step on the host
(:class:`~lightning_memkit.callbacks.OffloadOptimizer`); the same math, the state's bytes counted as host memory, the
gradients and parameters crossing the host link every optimizer step (a cost in the step time model). With gradient
accumulation (micro-batches included) the gradients accumulate on the device and leave it at the step.

    >>> from lightning_memkit.estimate.levers.offload_optimizer import OFFLOAD_OPTIMIZER
    >>> OFFLOAD_OPTIMIZER.kind, OFFLOAD_OPTIMIZER.words(True, False)
    ('work', 'optimizer state on the host')
"""

from __future__ import annotations

from typing import Any

from lightning_memkit.estimate.levers.base import StepCost, StepSpec, TrainerEdit
from lightning_memkit.estimate.levers.optimizer_in_backward import OPTIMIZER_IN_BACKWARD
from lightning_memkit.estimate.levers.optimizer_state import OptimizerStateLever

__all__ = ["OFFLOAD_OPTIMIZER", "OffloadOptimizerLever"]


class OffloadOptimizerLever(OptimizerStateLever):
    name, kind, keeps_math = "offload_optimizer", "work", True
    callback = "lightning_memkit.callbacks.OffloadOptimizer"
    label = "optimizer state on the host"
    host_choices = (True,)

    def scale_cost(self, choice: Any, base: Any, cost: StepCost, run: Any, est: Any = None,
                   machine: Any = None) -> StepCost:
        """Once per optimizer step: the gradients down and the parameters up the host link, and the host's step
        (AdamW reads a parameter, its gradient and two moments and writes three: seven passes at the host's memory
        bandwidth)."""
        if not choice or est is None or machine is None:
            return cost
        size = 2 if getattr(est, "precision", "") in ("bf16-true", "16-true") else 4
        trainable = getattr(est, "trainable_parameters", 0) * size
        return cost.replace(link=cost.link + 2 * trainable / machine.link_bytes_per_s,
                            once=cost.once + 7 * trainable / machine.host_bandwidth)

    def wrap(self, factory: Any) -> Any:
        from lightning_memkit.optim.host_offload import host_offload

        return host_offload(factory)

    def wrap_in_backward(self, factory: Any) -> Any:
        from lightning_memkit.optim.host_offload import host_offload

        return host_offload(factory, offload_gradients=True)

    def to_step(self, choice: Any, spec: StepSpec) -> None:
        if choice and spec.steps_in_backward:  # one wrapper for both: gradients leave the device as they complete
            spec.optimizer[:] = [w for w in spec.optimizer if w != OPTIMIZER_IN_BACKWARD.wrap]
            spec.optimizer.append(self.wrap_in_backward)
        else:
            super().to_step(choice, spec)

    def entry_for(self, plan: Any) -> dict[str, Any]:
        entry: dict[str, Any] = {"class_path": self.callback}
        if plan.get("optimizer_in_backward"):
            entry["init_args"] = {"offload_gradients": True}
        return entry

    def apply(self, choice: Any, base: Any, edit: TrainerEdit) -> None:
        from lightning_memkit.common.class_paths import instantiate

        if choice and not base:
            entry = self.entry_for(edit.plan or {})
            edit.added.append(instantiate(entry))
            gradients = ", gradients offloaded as they complete" if entry.get("init_args") else ""
            edit.change(f"{self.label}{gradients} (OffloadOptimizer)")

OFFLOAD_OPTIMIZER = OffloadOptimizerLever()
