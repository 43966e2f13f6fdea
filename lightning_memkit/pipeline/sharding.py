"""Pipeline stages sharded over data-parallel replicas with FSDP2 (``fully_shard``), as torchtitan composes PP x FSDP.

:func:`shard_stage_modules` applies ``torch.distributed.fsdp.fully_shard`` over a 1-D ``DeviceMesh`` (the ``dp``
dimension) to every pipeline layer of each stage module, then to the stage module itself, before torch's
``PipelineStage`` wraps it: ``PipelineStage`` then all-gathers each layer for its forward and backward,
reduce-scatters the gradients (averaged over the replicas) at the last microbatch only, and frees the gathered
weights after use. Each rank keeps ``1/dp`` of its stages' parameters, gradients and optimizer state.

:func:`full_state` gathers every sharded tensor of a (nested) state dict into a full one, so that one replica can
write a checkpoint that loads into any number of replicas; :func:`reshard_optimizer_state` cuts an optimizer's
loaded full state back to the shards of its parameters.

:func:`local` is the rank's own piece of a possibly sharded tensor (a ``DTensor``'s local shard), for arithmetic
on gradients that must not trigger collectives (norms, scaling, sums over a tie).

Example (one process, a 1-rank mesh)::

    >>> import os, torch, torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from lightning_memkit.pipeline.runtime import LayerChain
    >>> from lightning_memkit.pipeline.sharding import local, shard_stage_modules
    >>> os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    >>> dist.init_process_group("gloo", rank=0, world_size=1)
    >>> stage = LayerChain(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> shard_stage_modules([stage], init_device_mesh("cpu", (1,)))
    >>> type(stage[0].weight).__name__, tuple(local(stage[0].weight).shape)
    ('DTensor', (4, 4))
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["full_state", "local", "reshard_optimizer_state", "shard_stage_modules"]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` if it is a ``DTensor``, else ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def shard_stage_modules(modules: Sequence[nn.Module], mesh) -> None:
    """``fully_shard`` each pipeline layer (the children of a stage module that hold parameters), then the stage."""
    from torch.distributed.fsdp import fully_shard

    for module in modules:
        for layer in _layers(module):
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)


def _layers(module: nn.Module) -> list[nn.Module]:
    """The pipeline layers of a stage module (a ``LayerChain``'s children)."""
    return list(module.children())


def full_state(obj: Any) -> Any:
    """``obj`` with every ``DTensor`` (nested in dicts, lists and tuples) replaced by its full tensor (a collective)."""
    if hasattr(obj, "full_tensor") and isinstance(obj, torch.Tensor):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: full_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full_state(v) for v in obj)
    return obj


@torch.no_grad()
def reshard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Per-parameter state tensors of ``optimizer`` shaped like a sharded parameter become shards like it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for param, state in optimizer.state.items():
        if not isinstance(param, DTensor):
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
                state[key] = distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
