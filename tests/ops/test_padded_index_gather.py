import os

import pytest
import torch

from lightning_memkit.memory import LivePeak, release_storage
from lightning_memkit.ops import padded_index_gather
from lightning_memkit.ops.padded_index_gather import padded_rows


@pytest.mark.parametrize("shape", [(10, 3), (7, 2, 5), (5,)])
@pytest.mark.parametrize("multiple", [1, 4, 1024])
def test_matches_indexing_and_pads_the_allocation(shape, multiple):
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([4, 0, 4, 2, 1, 4, 0])
    y = padded_index_gather(x, idx, multiple)
    assert y.shape == (7, *shape[1:]) and y.is_contiguous() and not y._is_view()
    assert torch.equal(y, x[idx])
    row_bytes = x[0].numel() * x.element_size()
    assert y.untyped_storage().nbytes() == padded_rows(7, multiple) * row_bytes
    weights = torch.randn_like(y)
    (y * weights).sum().backward()
    # oracle: the gradient of a gather is a scatter-add; repeated rows sum
    want = torch.zeros_like(x)
    for i, j in enumerate(idx.tolist()):
        want[j] += weights[i]
    assert torch.allclose(x.grad, want, rtol=0, atol=1e-12)


def test_int32_index_empty_index_and_no_grad():
    x = torch.randn(6, 4)
    assert torch.equal(padded_index_gather(x, torch.tensor([5, 1], dtype=torch.int32), 8), x[[5, 1]])
    e = padded_index_gather(x, torch.empty(0, dtype=torch.long), 8)
    assert e.shape == (0, 4) and e.untyped_storage().nbytes() == 0


def test_keeps_zero_bytes_of_its_input():
    with LivePeak() as lp:
        x = torch.randn(256, 32, requires_grad=True) * 1  # 32 KiB activation
        idx = torch.randint(0, 256, (300,))
        y = padded_index_gather(x, idx, 128)
        live = lp.live_bytes
        del x  # the graph must not hold it
        assert live - lp.live_bytes == 256 * 32 * 4
        y.sum().backward()
    with LivePeak() as lp:
        x = torch.randn(256, 32, requires_grad=True) * 1
        z = torch.gather(x, 0, idx[:, None].expand(-1, 32))  # the baseline keeps its input
        live = lp.live_bytes
        del x
        assert live - lp.live_bytes == 0
        del z


def test_allocator_sees_few_distinct_sizes():
    x = torch.randn(512, 8)
    sizes = {padded_index_gather(x, torch.randint(0, 512, (n,)), 256).untyped_storage().nbytes()
             for n in range(700, 1025, 13)}
    assert sizes == {768 * 32, 1024 * 32}


def test_output_can_be_released_with_its_padding():
    x = torch.randn(40, 4, requires_grad=True)
    y = padded_index_gather(x * 1, torch.arange(40).flip(0), 64)
    out = y.sum(dim=1)
    assert release_storage(y, outputs=out) == 64 * 4 * 4
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_bad_inputs():
    x = torch.randn(5, 3)
    idx = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="pad_to_multiple=0"):
        padded_index_gather(x, idx, 0)
    with pytest.raises(ValueError, match="pad_to_multiple=True"):
        padded_index_gather(x, idx, True)
    with pytest.raises(ValueError, match="1-D int32/int64"):
        padded_index_gather(x, idx.float())
    with pytest.raises(ValueError, match="1-D int32/int64"):
        padded_index_gather(x, idx.view(1, 2))
    with pytest.raises(ValueError, match=r"holds 5, outside \[0, 5\)"):
        padded_index_gather(x, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"holds -1"):
        padded_index_gather(x, torch.tensor([-1, 2]))
    with pytest.raises(ValueError, match="at least one dimension"):
        padded_index_gather(torch.tensor(1.0), idx)
    with pytest.raises(TypeError, match="takes tensors"):
        padded_index_gather(x, [0, 1])
    with pytest.raises(ValueError, match="backend='cuda'"):
        padded_index_gather(x, idx, backend="cuda")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            padded_index_gather(x, idx, backend="triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interpreted_triton_kernel_matches_indexing():
    """The Triton kernel on CPU under TRITON_INTERPRET=1: run by the subprocess of
    ``test_triton_cross_entropy.py::test_triton_kernels_in_a_subprocess`` (the variable must be set before triton
    decorates the kernel, and stays there)."""
    for dtype, shape, n in [(torch.float32, (9, 5), 13), (torch.bfloat16, (6, 3, 7), 4), (torch.int64, (4,), 6)]:
        x = (torch.randn(*shape) * 100).to(dtype)
        for idx_dtype in (torch.int64, torch.int32):
            idx = torch.randint(0, shape[0], (n,), dtype=idx_dtype)
            y = padded_index_gather(x, idx, 8, backend="triton")
            assert torch.equal(y, x[idx.long()]), (dtype, shape)
            assert y.untyped_storage().nbytes() == -(-n // 8) * 8 * x[0].numel() * x.element_size()
    e = padded_index_gather(torch.randn(5, 3), torch.empty(0, dtype=torch.long), 8, backend="triton")
    assert e.shape == (0, 3)
    x = torch.randn(7, 4, requires_grad=True)
    y = padded_index_gather(x, torch.tensor([6, 6, 0]), 4, backend="triton")
    y.sum().backward()
    assert x.grad[6].eq(2).all() and x.grad[0].eq(1).all() and x.grad[1:6].eq(0).all()


@pytest.mark.cuda
def test_cuda_triton_matches_and_allocator_reuses_blocks():
    torch.cuda.init()
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(8192, 256, device=dev)
    for n in (1, 1000, 5000):
        idx = torch.randint(0, 8192, (n,), device=dev)
        assert torch.equal(padded_index_gather(x, idx, 1024, backend="triton"), x[idx])

    counts = [4096 + 97 * i for i in range(24)]  # routed-token counts of 24 microbatches

    def distinct_requested_sizes(multiple):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        try:
            for n in counts:
                idx = torch.randint(0, 8192, (n,), device=dev)
                y = padded_index_gather(x, idx, multiple)
                del y
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        row = 256 * 4
        return {e["size"] for e in snap["device_traces"][dev.index]
                if e["action"] == "alloc" and e["size"] >= counts[0] * row}

    padded = distinct_requested_sizes(1024)
    exact = distinct_requested_sizes(1)
    assert padded == {padded_rows(n, 1024) * 256 * 4 for n in counts}
    assert len(padded) == 4 and len(exact) == len(counts) == 24
