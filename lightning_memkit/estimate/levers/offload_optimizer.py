"""The ``offload_optimizer`` lever: the optimizer state and step on the host
(:class:`~lightning_memkit.callbacks.OffloadOptimizer`); the same math, the state's bytes counted as host memory, the
gradients and parameters crossing the host link every step (a cost in the step time model).

    >>> from lightning_memkit.estimate.levers.offload_optimizer import OFFLOAD_OPTIMIZER
    >>> OFFLOAD_OPTIMIZER.kind, OFFLOAD_OPTIMIZER.words(True, False)
    ('work', 'optimizer state on the host')
"""

from __future__ import annotations

from typing import Any

from lightning_memkit.estimate.levers.base import StepCost
from lightning_memkit.estimate.levers.optimizer_state import OptimizerStateLever

__all__ = ["OFFLOAD_OPTIMIZER", "OffloadOptimizerLever"]


class OffloadOptimizerLever(OptimizerStateLever):
    name, kind, keeps_math = "offload_optimizer", "work", True
    callback = "lightning_memkit.callbacks.OffloadOptimizer"
    label = "optimizer state on the host"

    def scale_cost(self, choice: Any, base: Any, cost: StepCost, run: Any, est: Any = None,
                   machine: Any = None) -> StepCost:
        """Once per optimizer step: the gradients down and the parameters up the host link, and the host's step
        (AdamW reads a parameter, its gradient and two moments and writes three: seven passes at the host's memory
        bandwidth)."""
        if not choice or est is None or machine is None:
            return cost
        from lightning_memkit.measure.machine import probe_machine

        size = 2 if getattr(est, "precision", "") in ("bf16-true", "16-true") else 4
        trainable = getattr(est, "trainable_parameters", 0) * size
        host = machine if machine.device.startswith("cpu") else probe_machine("cpu")
        return cost.replace(link=cost.link + 2 * trainable / machine.link_bytes_per_s,
                            once=cost.once + 7 * trainable / host.memory_bytes_per_s)

    def wrap(self, factory: Any) -> Any:
        from lightning_memkit.optim.host_offload import host_offload

        return host_offload(factory)


OFFLOAD_OPTIMIZER = OffloadOptimizerLever()
