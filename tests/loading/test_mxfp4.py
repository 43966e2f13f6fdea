import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_memkit.loading import dequantize_mxfp4
from lightning_memkit.loading.mxfp4 import CHUNK_BYTES, _Tables, chunk_transient_bytes, default_rows_per_chunk
from lightning_memkit.memory import LivePeak

FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
            torch.float64: torch.int64}


def reference(blocks, scales, dtype):
    """Straightforward fp64 oracle: unpack low then high nibble, scale by 2**(s - 127), swap the last two dims."""
    table = torch.tensor(FP4, dtype=torch.float64)
    b = blocks.long()
    codes = torch.stack((b & 15, b >> 4), dim=-1)  # [..., R, G, 16, 2]
    values = table[codes] * torch.pow(2.0, scales.double() - 127)[..., None, None]
    values = values.flatten(-3)  # [..., R, 32 G]
    return values.transpose(-1, -2).to(dtype)


def random_pair(shape, low=100, high=150):
    *lead, rows, groups = shape
    blocks = torch.randint(0, 256, (*lead, rows, groups, 16), dtype=torch.uint8)
    scales = torch.randint(low, high, (*lead, rows, groups), dtype=torch.uint8)
    return blocks, scales


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


@settings(max_examples=25, deadline=None)
@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    rows=st.integers(1, 9),
    groups=st.integers(1, 3),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    rows_per_chunk=st.one_of(st.none(), st.integers(1, 10)),
    seed=st.integers(0, 2**16),
)
def test_bit_exact_against_reference(lead, rows, groups, dtype, rows_per_chunk, seed):
    torch.manual_seed(seed)
    blocks, scales = random_pair((*lead, rows, groups), low=0, high=256)  # every exponent, extremes included
    got = dequantize_mxfp4(blocks, scales, dtype=dtype, rows_per_chunk=rows_per_chunk)
    assert same_bits(got, reference(blocks, scales, dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_every_byte_with_every_exponent(dtype):
    """Row r has scale r in every group; the 16 groups of 16 bytes hold the bytes 0..255 (overflow, subnormals)."""
    blocks = torch.arange(256, dtype=torch.uint8).view(1, 16, 16).expand(256, 16, 16).contiguous()
    scales = torch.arange(256, dtype=torch.uint8).view(256, 1).expand(256, 16).contiguous()
    got = dequantize_mxfp4(blocks, scales, dtype=dtype, rows_per_chunk=100)
    assert same_bits(got, reference(blocks, scales, dtype))


def test_value_layout_by_hand():
    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    blocks[0, 1, 0, 0] = 0x7A  # low nibble 0xA -> -1.0, high nibble 0x7 -> 6.0
    scales = torch.tensor([[[127], [129]]], dtype=torch.uint8)  # x1 and x4
    w = dequantize_mxfp4(blocks, scales, dtype=torch.float32)
    assert w.shape == (1, 32, 2)  # [experts, in = 32 * groups, out = rows]
    assert w[0, 0, 1].item() == -4.0 and w[0, 1, 1].item() == 24.0
    assert w[0, 2:, 1].abs().sum().item() == 0 and w[0, :, 0].abs().sum().item() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bit_exact_against_transformers(dtype):
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = random_pair((3, 40, 4), low=0, high=256)  # includes the extremes 0 and 255
    scales[0, 0, 0], scales[0, 1, 0] = 0, 255
    expected = mx.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert same_bits(dequantize_mxfp4(blocks, scales, dtype=dtype, rows_per_chunk=7), expected)


def test_writes_into_strided_out_of_any_device_layout():
    blocks, scales = random_pair((2, 12, 2))
    base = torch.full((2, 12, 64), 7.0, dtype=torch.float32)
    out = base.transpose(1, 2)  # [2, 64, 12], not contiguous
    assert dequantize_mxfp4(blocks, scales, out=out, rows_per_chunk=5) is out
    assert same_bits(out.contiguous(), reference(blocks, scales, torch.float32))
    param = torch.nn.Parameter(torch.empty(2, 64, 12, dtype=torch.bfloat16))
    dequantize_mxfp4(blocks, scales, out=param)  # a parameter that requires grad: written under no_grad
    assert same_bits(param.detach(), reference(blocks, scales, torch.bfloat16))


def test_standalone_peak_is_the_output_plus_one_bounded_chunk():
    blocks, scales = random_pair((4, 256, 8))
    with LivePeak() as lp:
        out = dequantize_mxfp4(blocks, scales)
    out_bytes = out.numel() * out.element_size()
    assert lp.live_bytes == out_bytes
    assert out_bytes < lp.peak_bytes <= 1.1 * out_bytes


def _table_bytes(dtype):
    with LivePeak() as lp:
        tables = _Tables(dtype, torch.device("cpu"))
        del tables
    return lp.peak_bytes


@pytest.mark.parametrize("rows_per_chunk", [4, 32])
def test_peak_into_out_is_one_chunk(rows_per_chunk):
    blocks, scales = random_pair((4, 256, 8))
    out = torch.empty(4, 256, 256, dtype=torch.bfloat16)
    with LivePeak() as lp:
        dequantize_mxfp4(blocks, scales, out=out, rows_per_chunk=rows_per_chunk)
    chunk = chunk_transient_bytes(rows_per_chunk, 8, torch.bfloat16)
    tables = _table_bytes(torch.bfloat16)
    # the value pairs of one chunk (2 bf16 per byte) are certainly live at once; never more than chunk + tables
    assert rows_per_chunk * 8 * 16 * 4 < lp.peak_bytes <= chunk + tables
    assert lp.live_bytes == 0


@pytest.mark.parametrize("shape", [(4, 2880, 90, 16), (128, 5760, 90, 16), (8, 64, 2, 16), (3, 16)])
def test_default_chunks_are_bounded(shape):
    shape = shape if len(shape) == 4 else (shape[0], shape[1], 1, 16)
    out_bytes = math.prod(shape[:-1]) * 32 * 2
    new = default_rows_per_chunk(shape, torch.bfloat16)
    into = default_rows_per_chunk(shape, torch.bfloat16, into_out=True)
    assert new >= 1 and into >= new
    if new > 1:
        assert chunk_transient_bytes(new, shape[-2], torch.bfloat16, moved=True) <= min(CHUNK_BYTES, out_bytes / 16)
    assert into == 1 or chunk_transient_bytes(into, shape[-2], torch.bfloat16, moved=True) <= CHUNK_BYTES


def test_bad_inputs_name_the_tensor():
    blocks, scales = random_pair((2, 4, 1))
    with pytest.raises(ValueError, match=r"weight_blocks: dtype torch.int8 is not allowed; MXFP4 .* torch.uint8"):
        dequantize_mxfp4(blocks.view(torch.int8), scales)
    with pytest.raises(ValueError, match=r"weight_scales: dtype torch.int32 is not allowed"):
        dequantize_mxfp4(blocks, scales.int())
    with pytest.raises(ValueError, match=r"weight_blocks: shape \[2, 4, 2, 8\] is not \[..., rows, groups, 16\]"):
        dequantize_mxfp4(blocks.view(2, 4, 2, 8), scales)
    with pytest.raises(ValueError, match=r"weight_scales: shape \[2, 3, 1\] does not match weight_blocks"):
        dequantize_mxfp4(blocks, scales[:, :3])
    with pytest.raises(ValueError, match=r"weight: target shape \[2, 4, 32\] does not match .* to \[2, 32, 4\]"):
        dequantize_mxfp4(blocks, scales, out=torch.empty(2, 4, 32))
    with pytest.raises(ValueError, match="dtype=torch.float16 differs from out.dtype=torch.float32"):
        dequantize_mxfp4(blocks, scales, out=torch.empty(2, 32, 4), dtype=torch.float16)
    with pytest.raises(ValueError, match="out is on the meta device"):
        dequantize_mxfp4(blocks, scales, out=torch.empty(2, 32, 4, device="meta"))
    with pytest.raises(ValueError, match="dtype=torch.int32 is not allowed"):
        dequantize_mxfp4(blocks, scales, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"rows_per_chunk=0: must be an int >= 1 or None"):
        dequantize_mxfp4(blocks, scales, rows_per_chunk=0)


@pytest.mark.cuda
def test_cuda_out_from_cpu_blocks_matches_and_is_chunk_bounded():
    blocks, scales = random_pair((4, 512, 16))
    out = torch.empty(4, 512, 512, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    dequantize_mxfp4(blocks, scales, out=out, rows_per_chunk=64)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= chunk_transient_bytes(64, 16, torch.bfloat16, moved=True) + 64 * 1024
    assert same_bits(out.cpu(), reference(blocks, scales, torch.bfloat16))
