"""FSDP2 as the project applies it: ``fully_shard`` on each repeated block, then on the root (the embedding, the
final norm and the head), as torchtitan does; and :func:`visible_resizes`, which tells the byte counters when FSDP2
allocates or frees a gathered parameter (it resizes storages in place, an op no dispatch mode sees).

Example (two ranks of a fake process group: each holds half of every parameter)::

    >>> import torch
    >>> from lightning_memkit.sharding import fake_mesh, shard_model
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    >>> with fake_mesh(2) as mesh:
    ...     _ = shard_model(net, mesh, blocks=list(net))
    ...     [tuple(p.to_local().shape) for p in net[0].parameters()]
    [(4, 8), (4,)]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["SHARDINGS", "is_sharded", "shard_model", "sharding_root", "visible_resizes"]

#: the ways a plan shards: ``"shard_grad_op"`` keeps each unit's gathered parameters from its forward to its backward
#: (one all-gather per step, as FSDP1's SHARD_GRAD_OP); ``"full_shard"`` frees them after the forward and gathers
#: them again in backward (FULL_SHARD: the least memory)
SHARDINGS = ("shard_grad_op", "full_shard")
_OWNER = "shard_model"


def shard_model(model: nn.Module, mesh: Any, *, blocks: Sequence[nn.Module] | None = None,
                reshard_after_forward: bool = True, offload: bool = False, mp_policy: Any = None) -> nn.Module:
    """Shard ``model`` over the 1-D DeviceMesh ``mesh``: ``fully_shard`` on each of ``blocks`` (default: its repeated
    blocks, :func:`~lightning_memkit.recompute.activation_recompute.repeated_blocks`), then on its root
    (:func:`sharding_root`: ``model``, or the one child of a LightningModule that holds all its parameters).

    ``reshard_after_forward``: free a unit's gathered parameters after its forward (``False``: keep them until its
    backward); ``offload``: parameters, gradients and optimizer state in host memory (FSDP2's ``CPUOffloadPolicy``,
    pinned where CUDA is); ``mp_policy``: FSDP2's ``MixedPrecisionPolicy``. Returns ``model`` (sharded in place).

    Raises:
        ValueError: ``model`` has no repeated blocks and none were given, or is sharded already.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    from lightning_memkit.recompute.activation_recompute import repeated_blocks

    if is_sharded(model):
        raise ValueError(f"{_OWNER}: {type(model).__name__} is sharded already")
    units = [m for _, m in repeated_blocks(model)] if blocks is None else list(blocks)
    if not units:
        raise ValueError(f"{_OWNER}: {type(model).__name__} has no nn.ModuleList of same-class blocks to shard one "
                         "unit each; pass blocks=")
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "offload_policy": policy}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(sharding_root(model), **kwargs)
    return model


def sharding_root(model: nn.Module) -> nn.Module:
    """The module whose call runs the forward, where FSDP2's root unit goes (its hooks run on a module's call): a
    LightningModule's child holding all of its parameters (its ``training_step`` calls that child, never itself),
    else ``model``."""
    if callable(getattr(model, "training_step", None)):
        params = {id(p) for p in model.parameters()}
        for child in model.children():
            if {id(p) for p in child.parameters()} == params:
                return child
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (sharded by FSDP2 or another parallelism)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


@contextlib.contextmanager
def visible_resizes() -> Iterator[None]:
    """Inside the block, each storage FSDP2 allocates or frees for a gathered parameter
    (``untyped_storage().resize_()``, unseen by dispatch modes) is reported to the active
    :class:`~lightning_memkit.measure.live_peak.LivePeak` trackers
    (:func:`~lightning_memkit.measure.live_peak.note_storage_resized`): without it they count a unit's gathered
    parameters as alive from its first all-gather to the end. Restored on exit."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    from lightning_memkit.measure.live_peak import note_storage_resized

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def noted_alloc(t: torch.Tensor) -> None:
        alloc(t)
        note_storage_resized(t)

    def noted_free(t: torch.Tensor) -> None:
        free(t)
        note_storage_resized(t)

    _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = noted_alloc
    _fsdp_param.free_storage = noted_free
    try:
        yield
    finally:
        _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = alloc
        _fsdp_param.free_storage = free
