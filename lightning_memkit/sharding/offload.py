"""FSDP2's CPU offload (``CPUOffloadPolicy``) as a GPU run places its bytes, in a one-process trace on CPU tensors,
where the "device" is the CPU too and FSDP2's copies between the two are no-ops. :func:`offloaded_like_a_gpu_run`
counts what a GPU run keeps on the host as host memory
(:func:`~lightning_memkit.measure.live_peak.host_memory`): the parameters' shards (pinned), each reduce-scattered
gradient shard (copied to the host, its device buffer freed) and, with :func:`steps_on_host`, the optimizer's state
and step; and each unit's all-gather inputs as the device copies a GPU run makes of its shards before gathering them.

Example (two ranks of a fake process group; the shards are host memory, the device holds no parameter between
steps)::

    >>> import torch
    >>> from lightning_memkit.measure.live_peak import LivePeak
    >>> from lightning_memkit.sharding import fake_mesh, shard_model
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(2)])
    >>> with fake_mesh(2) as mesh, LivePeak() as lp:
    ...     _ = shard_model(net, mesh, blocks=list(net), offload=True)
    ...     with offloaded_like_a_gpu_run(net):
    ...         pass
    ...     lp.host_live_bytes == 2 * 32 * 64 * 4
    True
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_memkit.measure.live_peak import host_memory, note_host

__all__ = ["offloaded_like_a_gpu_run", "steps_on_host"]


@contextlib.contextmanager
def offloaded_like_a_gpu_run(model: nn.Module) -> Iterator[None]:
    """In the block, ``model`` (sharded with ``offload=True``) keeps its bytes where a GPU run keeps them: its
    parameters' shards are host memory (told to the active trackers on entry), each unit's all-gather inputs are
    fresh (device) copies of its shards, and each gradient shard a reduce-scatter makes is copied to host memory
    (the device buffer it was a view of freed). Restored on exit."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if isinstance(p, DTensor)]
    for p in params:
        note_host(p.to_local())
    gather_inputs = FSDPParam.all_gather_inputs

    def device_copies(fsdp_param: Any) -> list[torch.Tensor]:
        inputs = gather_inputs.fget(fsdp_param)
        return [t.clone() for t in inputs] if fsdp_param.offload_to_cpu else inputs

    on_host: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()

    def gradient_to_host(p: torch.Tensor) -> None:
        if p.grad is None or p.grad._local_tensor in on_host:  # accumulated into its host shard already
            return
        with torch.no_grad(), host_memory():
            p.grad = p.grad.clone()
        on_host.add(p.grad._local_tensor)

    handles = [p.register_post_accumulate_grad_hook(gradient_to_host) for p in params if p.requires_grad]
    FSDPParam.all_gather_inputs = property(device_copies)
    try:
        yield
    finally:
        FSDPParam.all_gather_inputs = gather_inputs
        for handle in handles:
            handle.remove()


def steps_on_host(factory: Callable[[nn.Module], torch.optim.Optimizer]) -> Callable[[nn.Module],
                                                                                     torch.optim.Optimizer]:
    """``factory`` whose optimizers step in host memory: the state each ``step()`` makes is counted as host bytes,
    as a GPU run's optimizer over offloaded shards keeps it (an optimizer wrapper for
    :class:`~lightning_memkit.estimate.step_spec.StepSpec`)."""

    @functools.wraps(factory)
    def make(model: nn.Module) -> torch.optim.Optimizer:
        optimizer = factory(model)
        step = optimizer.step

        @functools.wraps(step)
        def host_step(*args: Any, **kwargs: Any) -> Any:
            with host_memory():
                return step(*args, **kwargs)

        optimizer.step = host_step  # type: ignore[method-assign]
        return optimizer

    return make
