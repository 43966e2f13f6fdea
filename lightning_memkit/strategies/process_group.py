"""The process plumbing of a multi-process Lightning strategy that does not wrap the model: launch, connect, talk.

:class:`ProcessGroupStrategy` is a :class:`~lightning.pytorch.strategies.ParallelStrategy` with what every
process-per-device strategy needs and nothing about the model: the launcher Lightning uses for its own strategies
(``popen`` re-runs the script, the others start processes with ``torch.multiprocessing``), world ranks from the
cluster environment, ``torch.distributed.init_process_group`` (``gloo`` on CPU, ``nccl`` on CUDA, the given
timeout), and the collectives Lightning calls (``barrier``, ``broadcast``, ``reduce``). Unlike ``DDPStrategy`` it
is not treated by Lightning as data-parallel: a subclass says itself, through ``is_distributed``, whether a
``DistributedSampler`` must be injected.

Example::

    >>> from lightning_memkit.strategies.process_group import ProcessGroupStrategy
    >>> ProcessGroupStrategy.__mro__[1].__name__
    'ParallelStrategy'
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only

__all__ = ["ProcessGroupStrategy"]

_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


class ProcessGroupStrategy(ParallelStrategy):
    """One process per device, connected by one ``torch.distributed`` process group; the model is left alone.

    Args:
        timeout: the process group's timeout.
        process_group_backend: ``None``: ``nccl`` on CUDA, ``gloo`` elsewhere.
        start_method: ``"popen"`` (re-run the script), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        **kwargs: ``ParallelStrategy``'s (accelerator, parallel_devices, cluster_environment, checkpoint_io,
            precision_plugin).
    """

    def __init__(self, *, timeout: timedelta, process_group_backend: str | None = None, start_method: str = "popen",
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._num_nodes = 1
        self._timeout = timeout
        self._process_group_backend = process_group_backend
        self._start_method = start_method

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str:
        return self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    def setup_distributed(self) -> None:
        """World ranks, then ``init_process_group`` with the cluster environment's address (once per process)."""
        reset_seed()
        self.set_world_ranks()
        if dist.is_initialized():
            return
        env = self.cluster_environment
        assert env is not None
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        device_id = self.root_device if self.root_device.type == "cuda" else None
        dist.init_process_group(self.process_group_backend, rank=env.global_rank(), world_size=env.world_size(),
                                timeout=self._timeout, device_id=device_id)

    def barrier(self, name: str | None = None) -> None:
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index or 0])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """``tensor`` reduced over ``group`` (default: every rank): ``"mean"`` (default), ``"sum"``, ``"max"``..."""
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
            return tensor
        name = "mean" if reduce_op is None else reduce_op.lower() if isinstance(reduce_op, str) else None
        if name is not None and name not in _OPS:
            raise ValueError(f"reduce_op={reduce_op!r}: must be a torch.distributed.ReduceOp or one of "
                             f"{', '.join(map(repr, _OPS))}")
        op = _OPS[name] if name is not None else reduce_op
        out = tensor.clone()
        dist.all_reduce(out, op=op, group=group)
        if name in ("mean", "avg"):
            out = out / dist.get_world_size(group)
        return out
