"""Gradient averaging over replicas and clipping by the global norm (lightning_memkit.pipeline.gradients)."""

import os

import pytest
import ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_memkit.pipeline.gradients import _buckets, average_gradients, clip_global_norm


def params_with_grads(seed: int, dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in [(5, 3), (7,), (2, 2, 2)]:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = torch.randn(shape, generator=g).to(dtype)
        out.append(p)
    return out


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_clip_matches_torch_clip_grad_norm_in_one_process(max_norm):
    ours, ref = params_with_grads(0), params_with_grads(0)
    norm = clip_global_norm(ours, max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    torch.testing.assert_close(norm, ref_norm)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    if max_norm > 1e8:  # below the limit: untouched, bit for bit
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, params_with_grads(0), strict=True))


def test_parameters_without_gradients_are_skipped_and_bad_arguments_are_named():
    p = torch.nn.Parameter(torch.ones(3))
    assert float(clip_global_norm([p], 1.0)) == 0.0 and p.grad is None
    with pytest.raises(ValueError, match=r"clip_global_norm\(max_norm=0\): must be a finite number > 0"):
        clip_global_norm(params_with_grads(0), 0)
    with pytest.raises(ValueError, match=r"average_gradients\(bucket_bytes=0\): must be an int >= 1"):
        average_gradients(params_with_grads(0), bucket_bytes=0)
    grads = [p.grad.clone() for p in params_with_grads(1)]
    ps = params_with_grads(1)
    average_gradients(ps)  # no process group: nothing to average with
    assert all(torch.equal(p.grad, g) for p, g in zip(ps, grads, strict=True))


def test_buckets_keep_order_split_by_dtype_device_and_size():
    f32 = [torch.zeros(4), torch.zeros(4), torch.zeros(8)]            # 16, 16, 32 bytes
    mixed = [f32[0], torch.zeros(2, dtype=torch.bfloat16), f32[1], f32[2]]
    assert [[t.numel() for t in b] for b in _buckets(f32, 32)] == [[4, 4], [8]]
    assert [[t.dtype for t in b] for b in _buckets(mixed, 1 << 20)] == [
        [torch.float32], [torch.bfloat16], [torch.float32, torch.float32]]
    assert [len(b) for b in _buckets([torch.zeros(100)], 8)] == [1]  # a larger gradient goes alone


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        # replicas: the same parameters, different gradients -> the mean on both, in small buckets
        reps = params_with_grads(10 + rank)
        average_gradients(reps, bucket_bytes=24)
        # stages: each rank owns other parameters -> one norm over both ranks
        stage = params_with_grads(20 + rank)
        norm = clip_global_norm(stage, 1.0)
        out[rank] = ([p.grad.clone() for p in reps], float(norm), [p.grad.clone() for p in stage])
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_average_replicas_and_clip_stages_together():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(ranks.free_port(), out), nprocs=2, join=True)
        results = dict(out)
    mean = [(a.grad + b.grad) / 2 for a, b in zip(params_with_grads(10), params_with_grads(11), strict=True)]
    for rank in (0, 1):
        for got, want in zip(results[rank][0], mean, strict=True):
            torch.testing.assert_close(got, want)
    whole = params_with_grads(20) + params_with_grads(21)  # the model of both stages in one process
    ref_norm = torch.nn.utils.clip_grad_norm_(whole, 1.0)
    assert results[0][1] == results[1][1] == pytest.approx(float(ref_norm), rel=1e-6)
    for got, want in zip(results[0][2] + results[1][2], [p.grad for p in whole], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
