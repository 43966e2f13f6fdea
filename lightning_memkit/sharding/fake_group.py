"""The world of ranks an estimate runs in, in one process: a DeviceMesh over torch's fake process group, whose
collectives make their outputs (shapes and bytes, fake tensors under the estimate's fake mode) and send nothing; this
process stands for one rank (rank 0: its shards are the largest where a size does not divide evenly).

Example::

    >>> import torch.distributed as dist
    >>> from lightning_memkit.sharding import current_mesh, fake_mesh
    >>> with fake_mesh(4) as mesh:
    ...     mesh.size(), current_mesh() is mesh
    (4, True)
    >>> dist.is_initialized()
    False
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Iterator
from typing import Any

__all__ = ["current_mesh", "fake_mesh"]

_MESH: contextvars.ContextVar[Any] = contextvars.ContextVar("memkit_fake_mesh", default=None)
_NAMES = itertools.count()


def current_mesh() -> Any:
    """The mesh of the innermost :func:`fake_mesh` block (``None`` outside one)."""
    return _MESH.get()


@contextlib.contextmanager
def fake_mesh(world_size: int, rank: int = 0) -> Iterator[Any]:
    """A 1-D CPU DeviceMesh of ``world_size`` ranks over the fake process group, this process as ``rank``, for the
    block. Without a process group it is the default group for the block (torch's ``"fake"`` backend, as
    torchtitan's memory estimation uses); beside a real default group (a rank of a real run planning), a group of its
    own, registered for the block and removed after.

    Raises:
        ValueError: ``world_size`` below 2 or ``rank`` outside it.
    """
    import torch.distributed as dist

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"fake_mesh(world_size=...) must be an int >= 2, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"fake_mesh(rank=...) must be in [0, {world_size}), got {rank!r}")
    group = _default_group if not dist.is_initialized() else _side_group
    with group(world_size, rank) as mesh:
        token = _MESH.set(mesh)
        try:
            yield mesh
        finally:
            _MESH.reset(token)


@contextlib.contextmanager
def _default_group(world_size: int, rank: int) -> Iterator[Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _side_group(world_size: int, rank: int) -> Iterator[Any]:
    """A fake group beside the real default one: registered in c10d's tables as ``new_group`` registers a group (which
    refuses more ranks than the real world has), removed on exit."""
    import torch
    import torch.distributed
    from torch._C._distributed_c10d import FakeProcessGroup
    from torch.distributed import ProcessGroup
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh

    name = f"memkit_fake_{next(_NAMES)}"
    store = torch.distributed.HashStore()
    pg = ProcessGroup(store, rank, world_size)
    pg._set_default_backend(ProcessGroup.BackendType.CUSTOM)
    backend = FakeProcessGroup._create_internal(rank, world_size, FakeProcessGroup.Options())
    pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.CUSTOM, backend)
    pg._set_group_name(name)
    world = c10d._world
    world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    world.pg_map[pg] = ("fake", store)
    world.pg_names[pg] = name
    world.pg_backend_config[pg] = "cpu:fake"
    c10d._register_process_group(name, pg)
    try:
        yield DeviceMesh.from_group(pg, "cpu")
    finally:
        for table in (world.pg_group_ranks, world.pg_map, world.pg_names, world.pg_backend_config):
            table.pop(pg, None)
        c10d._unregister_process_group(name)
