"""QuantizedExperts: per-expert quantization decoded exactly, no-save matmul per expert, exact retained bytes."""

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from lightning_memkit.memory import LivePeak  # noqa: E402
from lightning_memkit.ops.nosave_experts import QuantizedExperts  # noqa: E402

MODES = ["nf4", "nf4-dq", "fp4", "fp4-dq", "int8"]
E, IN, OUT = 3, 48, 40  # 48 columns: not a multiple of the 64-element block (blocks straddle rows)


def _weight(seed=0, transposed=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, OUT, IN, generator=g)
    return w.transpose(1, 2).contiguous() if transposed else w


def _reference_dequant(q: QuantizedExperts, e: int) -> torch.Tensor:
    """Decode expert ``e`` from the stored bytes in float64, independently of bitsandbytes' kernels."""
    if q.mode == "int8":
        return q.weight[e].double() * q.scb[e].double().unsqueeze(1) / 127
    packed = q.weight[e]
    nibbles = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[: IN * OUT].long()
    code = bnb.functional.get_4bit_type(q.mode[:3], device="cpu").double()
    absmax = q.absmax[e].double()
    if q.nested:
        blocks = torch.arange(absmax.numel()) // 256
        absmax = q.nested_code.double()[q.absmax[e].long()] * q.nested_absmax[e].double()[blocks] + q.offset[e]
    scale = absmax.repeat_interleave(q.blocksize)[: IN * OUT]
    return (code[nibbles] * scale).reshape(OUT, IN)


@pytest.mark.parametrize("mode", MODES)
def test_storage_layout_and_exact_decoding(mode):
    w = _weight()
    q = QuantizedExperts.from_weight(w, mode)
    n = IN * OUT
    if mode == "int8":
        assert q.weight.dtype == torch.int8 and q.weight.shape == (E, OUT, IN) and q.scb.shape == (E, OUT)
    else:
        assert q.weight.dtype == torch.uint8 and q.weight.shape == (E, n // 2)
        assert q.absmax.shape == (E, n // 64) and q.absmax.dtype == (torch.uint8 if q.nested else torch.float32)
    assert not q.weight.requires_grad and [n for n, _ in q.named_parameters()] == ["weight"]
    for e in range(E):
        dense = q.dequantize(e)
        torch.testing.assert_close(dense.double(), _reference_dequant(q, e), rtol=1e-6, atol=1e-6)
        # the round trip is a quantization of this expert (per-element error below the coarsest code gap)
        assert (dense - w[e]).abs().max() <= 0.3 * w[e].abs().max()
    assert q.dequantize().shape == (E, OUT, IN)


def test_transposed_layout_is_the_same_quantization():
    a = QuantizedExperts.from_weight(_weight(), "nf4")
    b = QuantizedExperts.from_weight(_weight(transposed=True), "nf4", transposed=True)
    assert (b.in_features, b.out_features) == (IN, OUT)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.absmax, b.absmax)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_backward_match_the_dequantized_reference(mode, bias):
    dtype = torch.float16 if mode == "int8" else torch.float32
    q = QuantizedExperts.from_weight(_weight(), mode, compute_dtype=dtype)
    b = torch.randn(OUT, dtype=dtype, requires_grad=True) if bias else None
    x = torch.randn(2, 5, IN, dtype=dtype, requires_grad=True)
    out = q(x, 1, b)
    assert out.shape == (2, 5, OUT) and out.dtype == dtype
    grad = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(dtype)
    gx, *gb = torch.autograd.grad(out, [x, *([b] if bias else [])], grad)
    x64 = x.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if bias else None
    ref = torch.nn.functional.linear(x64, _reference_dequant(q, 1), b64)
    rgx, *rgb = torch.autograd.grad(ref, [x64, *([b64] if bias else [])], grad.double())
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    for actual, expected in ((out, ref), (gx, rgx), *zip(gb, rgb)):
        err = (actual.double() - expected).abs().max().item()
        assert err <= tol * expected.abs().max().item(), err


def test_bf16_compute_of_float32_input_returns_float32():
    q = QuantizedExperts.from_weight(_weight(), "nf4-dq", compute_dtype=torch.bfloat16)
    x = torch.randn(4, IN)
    out = q(x, 0)
    assert out.dtype == torch.float32
    ref = torch.nn.functional.linear(x.double(), _reference_dequant(q, 0))
    assert (out.double() - ref).abs().max() <= 2e-2 * ref.abs().max()


@pytest.mark.parametrize("mode", MODES)
def test_forward_keeps_only_the_experts_packed_slice(mode):
    q = QuantizedExperts.from_weight(_weight(), mode)
    dtype = torch.float16 if mode == "int8" else torch.float32
    base = torch.randn(7, IN, dtype=dtype, requires_grad=True)
    seen = []
    with LivePeak() as lp:
        x = base * 1.0
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
            out = q(x, 2)
        del x
        retained = lp.live_bytes - out.untyped_storage().nbytes()
    assert retained == 0  # no input, no dequantized copy: only views of the module's own storage
    assert lp.peak_bytes == (7 * IN + OUT * IN + 7 * OUT) * dtype.itemsize  # input, one dense expert, output
    expected = q.saved_tensors(2)
    assert len(seen) == len(expected)
    for t, s in zip(seen, expected):
        assert t.untyped_storage().data_ptr() == s.untyped_storage().data_ptr() and t.shape == s.shape
    assert seen[0].data_ptr() == q.weight[2].data_ptr()  # expert 2's slice, not another expert's
    out.sum().backward()
    reference = torch.ones(7, OUT, dtype=torch.float64) @ _reference_dequant(q, 2)
    assert (base.grad.double() - reference).abs().max() <= 3e-3 * reference.abs().max()


@pytest.mark.parametrize("mode", ["nf4-dq", "int8"])
def test_state_dict_round_trip_restores_the_packed_experts(mode):
    q = QuantizedExperts.from_weight(_weight(), mode)
    fresh = QuantizedExperts(E, IN, OUT, mode)
    fresh.load_state_dict(q.state_dict())
    x = torch.randn(3, IN, dtype=torch.float16 if mode == "int8" else torch.float32)
    for e in range(E):
        assert torch.equal(fresh(x, e), q(x, e))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: QuantizedExperts.from_weight(torch.randn(4, 4), "nf4"), ValueError,
         r"weight must be a floating 3-D tensor \(num_experts, rows, columns\), got torch.float32 of shape \(4, 4\)"),
        (lambda: QuantizedExperts.from_weight(torch.ones(2, 4, 4, dtype=torch.int32), "nf4"), ValueError,
         "must be a floating 3-D tensor"),
        (lambda: QuantizedExperts.from_weight(torch.randn(2, 0, 4), "nf4"), ValueError,
         r"weight of shape \(2, 0, 4\) has no elements"),
        (lambda: QuantizedExperts.from_weight(torch.randn(2, 4, 4, device="meta"), "nf4"), ValueError,
         "is on the meta device"),
        (lambda: QuantizedExperts.from_weight([[[1.0]]], "nf4"), TypeError, "weight must be a torch.Tensor, got list"),
        (lambda: QuantizedExperts.from_weight(torch.randn(2, 4, 4), "nf8"), ValueError,
         r"QuantizedExperts\(mode='nf8'\): must be one of 'nf4', 'nf4-dq', 'fp4', 'fp4-dq', 'int8'"),
        (lambda: QuantizedExperts.from_weight(torch.randn(2, 4, 4), "nf4", transposed=1), TypeError,
         r"QuantizedExperts\(transposed=1\): must be a bool"),
        (lambda: QuantizedExperts(2, 4, 4, "nf4", blocksize=32), ValueError,
         r"QuantizedExperts\(blocksize=32\): must be one of 64, 128"),
        (lambda: QuantizedExperts(2, 4, 4, "nf4", compute_dtype=torch.float64), ValueError,
         r"QuantizedExperts\(compute_dtype=torch.float64\): must be one of"),
        (lambda: QuantizedExperts.from_weight(torch.full((2, 4, 4), 1e5), "int8"), ValueError,
         r"expert 0 has values beyond float16's range \(max \|w\| = 1e\+05\)"),
        (lambda: QuantizedExperts(0, 4, 4, "nf4"), ValueError,
         r"QuantizedExperts\(num_experts=0\): must be an int >= 1"),
    ],
)
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_bad_calls():
    q = QuantizedExperts.from_weight(_weight(), "nf4")
    with pytest.raises(ValueError, match=r"expert=3 is out of range; allowed: an int 0 \.\. 2"):
        q(torch.randn(2, IN), 3)
    with pytest.raises(ValueError, match=r"expert=-1 is out of range"):
        q.dequantize(-1)
    with pytest.raises(ValueError, match=r"expert=1.0 is out of range"):
        q(torch.randn(2, IN), 1.0)
    torch.testing.assert_close(q(torch.ones(2, IN), torch.tensor(1)), q(torch.ones(2, IN), 1))
    with pytest.raises(ValueError, match="x has 47 features in its last dimension; the experts expect 48"):
        q(torch.randn(2, IN - 1), 0)
    with pytest.raises(TypeError, match="x must be a floating-point tensor, got torch.int64"):
        q(torch.ones(2, IN, dtype=torch.long), 0)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["nf4", "nf4-dq", "int8"])
def test_cuda_matches_the_decoded_bytes(mode):
    dtype = torch.float16 if mode == "int8" else torch.bfloat16
    q = QuantizedExperts.from_weight(_weight().cuda(), mode, compute_dtype=dtype)
    assert q.weight.device.type == "cuda"
    x = torch.randn(6, IN, device="cuda", dtype=dtype, requires_grad=True)
    out = q(x, 1)
    out.float().sum().backward()
    dense = _reference_dequant(q.cpu(), 1)
    ref = torch.nn.functional.linear(x.detach().cpu().double(), dense)
    assert (out.detach().cpu().double() - ref).abs().max() <= 2e-2 * ref.abs().max()
    gref = torch.ones(6, OUT, dtype=torch.float64) @ dense
    assert (x.grad.cpu().double() - gref).abs().max() <= 2e-2 * gref.abs().max()


@pytest.mark.parametrize("mode", ["nf4", "nf4-dq", "fp4"])
def test_on_fake_tensors_one_expert_stands_for_all_with_the_same_peak(mode):
    """An estimate quantizes the first expert only (the others' storages come and go alike): LivePeak's peak and
    the packed result's sizes are those of quantizing every expert for real."""
    from lightning_memkit.estimate.trace import fake_tensors

    def quantize(fake: bool):
        with fake_tensors() if fake else torch.device("cpu"), LivePeak() as lp:
            q = QuantizedExperts.from_weight(torch.zeros(8, OUT, IN), mode)
            sizes = sorted((n, t.shape, t.dtype) for n, t in q.named_buffers())
        return lp.peak_bytes, sizes

    real, fake = quantize(False), quantize(True)
    assert fake == real and real[0] > 0


def test_int8_experts_quantize_on_fake_tensors():
    """The int8 range check reads values: an estimate (fake tensors) skips it instead of failing."""
    from lightning_memkit.estimate.trace import fake_tensors

    with fake_tensors():
        q = QuantizedExperts.from_weight(torch.zeros(8, OUT, IN), "int8")
    assert q.weight.shape == (8, OUT, IN) and q.weight.dtype == torch.int8
