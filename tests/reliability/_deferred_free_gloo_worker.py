"""Two gloo ranks: an all-to-all launched with async_op=True, its send buffer released by DeferredFree."""

import sys

import torch
import torch.distributed as dist

from lightning_memkit.memory import DeferredFree, UnsafeReleaseError
from lightning_memkit.release.storage_release import is_released


def main() -> None:
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.arange(8, dtype=torch.float32, requires_grad=True)

    # the documented MoE dispatch: hand the work over, overlap, wait through the entry
    send = x * (rank + 1)  # an activation: autograd metadata stays needed, the bytes do not
    received = torch.empty(8)
    free = DeferredFree()
    entry = free.defer(send, after=dist.all_to_all_single(received, send.detach(), async_op=True))
    entry.wait()
    freed = free.drain()
    assert freed == 32 and is_released(send), (freed, is_released(send))
    expected = torch.cat([torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32) * (r + 1) for r in range(world)])
    assert torch.equal(received, expected), (received, expected)

    # the buffer itself sent (no detach): the work holds it until the queue drops the completed handle
    buf = torch.randn(8) * 1
    out = torch.empty(8)
    free.defer(buf, after=dist.all_to_all_single(out, buf, async_op=True))
    assert free.drain(wait=True) == 32 and is_released(buf)

    # a work handle the caller still references keeps the tensor: refused, naming the cause, nothing freed
    buf = torch.randn(8) * 1
    work = dist.all_to_all_single(torch.empty(8), buf, async_op=True)
    free.defer(buf, after=work)
    try:
        free.drain(wait=True)
    except UnsafeReleaseError as err:
        assert "work handle" in str(err), str(err)
        assert not is_released(buf)
    else:
        raise AssertionError("a still-referenced work handle must refuse the release")
    del work  # the refused entry stays queued; with the handle gone it goes through
    assert free.drain() == 32 and is_released(buf) and len(free) == 0
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
