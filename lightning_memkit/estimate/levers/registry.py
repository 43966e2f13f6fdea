"""The levers the planner knows, in the order a plan lists them (and writes them as YAML). A new lever is one module
and one line here.

    >>> from lightning_memkit.estimate.levers.registry import LEVERS, lever
    >>> [x.name for x in LEVERS][:3], lever("recompute").kind
    (['precision', 'quantization', 'recompute'], 'work')
"""

from __future__ import annotations

from lightning_memkit.estimate.levers.base import Lever
from lightning_memkit.estimate.levers.fused_loss import FUSED_LOSS
from lightning_memkit.estimate.levers.micro_batch import MICRO_BATCH
from lightning_memkit.estimate.levers.offload_activations import OFFLOAD_ACTIVATIONS
from lightning_memkit.estimate.levers.offload_optimizer import OFFLOAD_OPTIMIZER
from lightning_memkit.estimate.levers.optimizer_8bit import OPTIMIZER_8BIT
from lightning_memkit.estimate.levers.optimizer_in_backward import OPTIMIZER_IN_BACKWARD
from lightning_memkit.estimate.levers.precision import PRECISION
from lightning_memkit.estimate.levers.quantization import QUANTIZATION
from lightning_memkit.estimate.levers.recompute import RECOMPUTE
from lightning_memkit.estimate.levers.sharding import SHARDING
from lightning_memkit.estimate.levers.stages import STAGES
from lightning_memkit.estimate.levers.tiled_mlp import TILED_MLP

__all__ = ["LEVERS", "lever"]

LEVERS: tuple[Lever, ...] = (
    PRECISION,
    QUANTIZATION,
    RECOMPUTE,
    OFFLOAD_ACTIVATIONS,
    FUSED_LOSS,
    TILED_MLP,
    SHARDING,
    MICRO_BATCH,
    OPTIMIZER_IN_BACKWARD,
    OFFLOAD_OPTIMIZER,
    OPTIMIZER_8BIT,
    STAGES,
)
_BY_NAME = {x.name: x for x in LEVERS}


def lever(name: str) -> Lever:
    """The registered lever called ``name``."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"{name!r} is not a lever; levers: {', '.join(_BY_NAME)}") from None
