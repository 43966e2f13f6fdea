"""Gradients across ranks: average over data-parallel replicas, clip by the norm of every rank's gradients together.

Both are plain ``torch.distributed`` collectives over a process group (a dimension of the pipeline's
``DeviceMesh``) and work the same in one process (``group=None`` without an initialized process group):

- :func:`average_gradients` sums each gradient over ``group`` and divides by its size, in buckets of at most
  ``bucket_bytes`` (one flat buffer per dtype and bucket, as DDP does), so that replicas step identically;
- :func:`clip_global_norm` computes the 2-norm of all gradients of all ranks of ``group`` (each rank passes the
  parameters it owns, each once) and scales every gradient by ``min(1, max_norm / (norm + 1e-6))``: the same
  update as ``torch.nn.utils.clip_grad_norm_`` over the whole model in one process.

Example (one process: the collectives are skipped)::

    >>> import torch
    >>> from lightning_memkit.pipeline.gradients import clip_global_norm
    >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
    >>> float(clip_global_norm([w], max_norm=1.0))   # the norm before clipping
    5.0
    >>> w.grad
    tensor([0.6000, 0.8000])
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from lightning_memkit.common.validation import check_int, check_number
from lightning_memkit.pipeline.sharding import local

__all__ = ["average_gradients", "broadcast_tensors", "clip_global_norm", "sum_gradients"]

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


def _distributed(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _buckets(grads: Sequence[torch.Tensor], bucket_bytes: int) -> Iterable[list[torch.Tensor]]:
    """Consecutive gradients of one dtype and device, at most ``bucket_bytes`` a bucket (a larger one alone)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if bucket and (size + nbytes > bucket_bytes or g.dtype != bucket[0].dtype or g.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += nbytes
    if bucket:
        yield bucket


def average_gradients(params: Iterable[torch.Tensor], group=None, *, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Replace each ``p.grad`` by its mean over the ranks of ``group`` (parameters without a gradient are skipped).

    Every rank of ``group`` must pass the same parameters in the same order (the replicas of one stage).
    """
    check_int(bucket_bytes, "bucket_bytes", minimum=1, owner="average_gradients")
    if not _distributed(group):
        return
    size = dist.get_world_size(group)
    grads = [p.grad for p in params if p.grad is not None]
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        del flat  # before the next bucket's buffer exists: one flat buffer at a time


def sum_gradients(params: Iterable[torch.Tensor], group=None) -> None:
    """Replace each ``p.grad`` by its sum over the ranks of ``group`` (the ranks that share these parameters).

    A parameter that requires a gradient but has none gets zeros first, so that every rank joins the collective.
    """
    if not _distributed(group):
        return
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(local(p.grad), group=group)


@torch.no_grad()
def broadcast_tensors(tensors: Iterable[torch.Tensor], src: int, group=None) -> None:
    """Copy ``src``'s values (a global rank) into the same tensors on every rank of ``group``, in place."""
    if not _distributed(group):
        return
    for t in tensors:
        dist.broadcast(t.data, src=src, group=group)


def clip_global_norm(
    params: Iterable[torch.Tensor], max_norm: float, group=None, *, device: torch.device | str | None = None,
    also_scale: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """Clip the gradients of every rank of ``group`` together by their global 2-norm; returns that norm (fp32).

    Each rank passes the parameters it owns (a parameter held by two ranks, such as a tied embedding, by one of
    them only, or its gradient counts twice). ``device``: where the norm is reduced (the process group's device;
    default: the first gradient's, else CPU). ``also_scale``: parameters whose gradients are scaled by the same
    factor without counting towards the norm (this rank's copy of a parameter that another rank counts).
    """
    max_norm = check_number(max_norm, "max_norm", minimum=0, min_inclusive=False, owner="clip_global_norm")
    grads = [p.grad for p in params if p.grad is not None]
    if device is None:
        device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:  # a sharded gradient adds its own shard: the group then sums the shards of every rank
        squares += torch.linalg.vector_norm(local(g).detach(), dtype=torch.float32).square().to(device)
    if _distributed(group):
        dist.all_reduce(squares, group=group)
    norm = squares.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in [*grads, *(p.grad for p in also_scale if p.grad is not None)]:
        shard = local(g).detach()
        shard.mul_(coef.to(shard.device, shard.dtype))
    return norm
