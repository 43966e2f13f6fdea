"""The ``offload_optimizer`` lever: the optimizer state and step on the host
(:class:`~lightning_memkit.callbacks.OffloadOptimizer`); the same math, the state's bytes counted as host memory, the
gradients and parameters crossing the host link every step (a cost in the step time model).

    >>> from lightning_memkit.estimate.levers.offload_optimizer import OFFLOAD_OPTIMIZER
    >>> OFFLOAD_OPTIMIZER.kind, OFFLOAD_OPTIMIZER.words(True, False)
    ('work', 'optimizer state on the host')
"""

from __future__ import annotations

from typing import Any

from lightning_memkit.estimate.levers.optimizer_state import OptimizerStateLever

__all__ = ["OFFLOAD_OPTIMIZER", "OffloadOptimizerLever"]


class OffloadOptimizerLever(OptimizerStateLever):
    name, kind, keeps_math = "offload_optimizer", "work", True
    callback = "lightning_memkit.callbacks.OffloadOptimizer"
    label = "optimizer state on the host"

    def wrap(self, factory: Any) -> Any:
        from lightning_memkit.optim.host_offload import host_offload

        return host_offload(factory)


OFFLOAD_OPTIMIZER = OffloadOptimizerLever()
