import math

import pytest
import torch

from lightning_memkit.memory import LivePeak
from lightning_memkit.ops import nosave_matmul
from lightning_memkit.ops.nosave_matmul import dequantize_weight, is_quantized, nosave_linear, saved_weight_tensors

bnb = pytest.importorskip("bitsandbytes")

MODES = ["nf4", "nf4-dq", "fp4", "fp4-dq", "int8"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
IN, OUT = 128, 96


def make_layer(mode: str, bias: bool, dtype: torch.dtype, device: str = "cpu"):
    """A bitsandbytes layer, quantized by bitsandbytes itself (``.to(device)``)."""
    if mode == "int8":
        layer = bnb.nn.Linear8bitLt(IN, OUT, bias=bias, has_fp16_weights=False)
    else:
        layer = bnb.nn.Linear4bit(
            IN, OUT, bias=bias, compute_dtype=dtype, quant_type=mode[:3], compress_statistics=mode.endswith("-dq")
        )
    if bias:
        torch.nn.init.uniform_(layer.bias, -0.5, 0.5)
    return layer.to(device)


def _input(dims: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    shape = (6, IN) if dims == 2 else (2, 3, IN)
    return torch.randn(shape, device=device).to(dtype).requires_grad_()


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    scale = expected.abs().max().item() + 1e-6
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} > {TOL[dtype]} x {scale:.3g}"


def _run(fn, x: torch.Tensor, bias: torch.Tensor | None):
    """Output, input grad and bias grad of ``fn(x)`` for a fixed non-trivial upstream gradient."""
    x.grad = None
    if bias is not None:
        bias.grad = None
    out = fn(x)
    upstream = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape).to(out.dtype)
    out.backward(upstream)
    return out.detach(), x.grad.clone(), None if bias is None else bias.grad.clone()


def _dtypes(mode: str) -> list[torch.dtype]:
    return [torch.float32, torch.float16 if mode == "int8" else torch.bfloat16]


CASES = [(m, d, b, dt) for m in MODES for d in (2, 3) for b in (True, False) for dt in _dtypes(m)]


@pytest.mark.parametrize(("mode", "dims", "bias", "dtype"), CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_matches_bitsandbytes_and_dequantized_reference(mode, dims, bias, dtype):
    layer = make_layer(mode, bias, dtype)
    x = _input(dims, dtype)
    ours = _run(lambda t: nosave_linear(t, layer), x, layer.bias)

    # the fp64 oracle: dequantize the packed weight, then an ordinary linear
    w = dequantize_weight(layer, torch.float32).double()
    b = layer.bias.double() if bias else None
    ref = _run(lambda t: torch.nn.functional.linear(t.double(), w, b).to(t.dtype), x, layer.bias)
    # bitsandbytes' own layer on the same packed weight
    theirs = _run(layer, x, layer.bias)

    assert ours[0].dtype == dtype and ours[0].shape == (*x.shape[:-1], OUT)
    assert ours[1].dtype == dtype and ours[1].shape == x.shape
    for expected in (ref, theirs):
        _close(ours[0], expected[0], dtype)
        _close(ours[1], expected[1], dtype)
        if bias:
            _close(ours[2], expected[2], dtype)
    assert layer.weight.grad is None


@pytest.mark.parametrize("mode", MODES)
def test_dequantize_weight_matches_bitsandbytes_public_functions(mode):
    layer = make_layer(mode, False, torch.float32)
    w = layer.weight
    if mode == "int8":
        expected = bnb.functional.int8_vectorwise_dequant(w.data, w.SCB)
    else:
        expected = bnb.functional.dequantize_4bit(w.data, w.quant_state)
    got = dequantize_weight(layer, torch.float32)
    assert got.shape == (OUT, IN)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    for dtype in (torch.float16, torch.bfloat16):
        assert dequantize_weight(layer, dtype).dtype == dtype
        torch.testing.assert_close(dequantize_weight(layer, dtype), expected.to(dtype), rtol=1e-2, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_saved_tensors_are_the_packed_weight_and_quant_state_only(mode):
    dtype = torch.float16 if mode == "int8" else torch.bfloat16
    layer = make_layer(mode, True, dtype)
    x = _input(3, dtype)
    seen: list[torch.Tensor] = []

    def pack(t):
        seen.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        nosave_linear(x, layer)
    assert any(t is layer.weight for t in seen), "the packed weight must go through save_for_backward"
    expected = {t.untyped_storage().data_ptr() for t in saved_weight_tensors(layer)}
    assert {t.untyped_storage().data_ptr() for t in seen} == expected
    assert all(t.numel() != x.numel() for t in seen), "no tensor of the input's size"
    assert not any(t.is_floating_point() and t.numel() == IN * OUT for t in seen), "no dequantized weight"
    kept_by_quant_state = 2 if mode == "int8" else (6 if mode.endswith("-dq") else 3)
    assert len(seen) == kept_by_quant_state


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cast", [False, True], ids=["same-dtype", "cast-to-compute-dtype"])
def test_forward_retains_zero_new_bytes(mode, cast):
    compute = torch.float16 if mode == "int8" else torch.bfloat16
    layer = make_layer(mode, True, compute)
    x_dtype = torch.float32 if cast else compute
    base = torch.randn(4, 16, IN).to(x_dtype).requires_grad_()
    with LivePeak() as lp:
        x = base * 1.0  # a non-leaf activation born inside the block, as in a network
        out = nosave_linear(x, layer, compute_dtype=compute)
        del x
        retained = lp.live_bytes - out.untyped_storage().nbytes()
    assert retained == 0
    size = compute.itemsize
    rows = base.numel() // IN
    # at the peak: the input, its cast to the compute dtype, one dense weight, the output and the bias in that dtype
    cast_bytes = rows * IN * size if cast else 0
    assert lp.peak_bytes == base.numel() * x_dtype.itemsize + cast_bytes + (OUT * IN + rows * OUT + OUT) * size
    out.sum().backward()
    assert base.grad.dtype == x_dtype
    w = dequantize_weight(layer, compute).double()
    _close(base.grad, torch.ones(*base.shape[:-1], OUT, dtype=torch.float64) @ w, compute)


def test_compute_dtype_and_output_dtype():
    layer = make_layer("nf4", False, torch.bfloat16)
    x = _input(2, torch.float32)
    out = nosave_linear(x, layer)
    assert out.dtype == torch.float32
    ref = nosave_linear(x.detach().to(torch.bfloat16), layer)
    torch.testing.assert_close(out, ref.float())  # computed in the layer's compute dtype
    out32 = nosave_linear(x, layer, compute_dtype=torch.float32)
    w = dequantize_weight(layer, torch.float32).double()
    _close(out32, torch.nn.functional.linear(x.double(), w), torch.float32)


def test_weight_argument_and_explicit_bias():
    layer = make_layer("nf4-dq", False, torch.float32)
    bias = torch.randn(OUT, requires_grad=True)
    x = _input(2, torch.float32)
    out = nosave_linear(x, layer.weight, bias, compute_dtype=torch.float32)
    torch.testing.assert_close(out, nosave_linear(x, layer) + bias)
    out.sum().backward()
    torch.testing.assert_close(bias.grad, torch.full((OUT,), float(x.shape[0])))
    assert is_quantized(layer) and is_quantized(layer.weight)


def test_no_grad_forward_builds_no_graph():
    layer = make_layer("int8", True, torch.float32)
    x = _input(2, torch.float32)
    with torch.no_grad():
        out = nosave_linear(x, layer)
    assert out.grad_fn is None and not out.requires_grad
    assert torch.equal(out, nosave_linear(x, layer).detach())  # the same numbers as with a graph


def test_errors_name_the_argument():
    plain = torch.nn.Linear(IN, OUT)
    with pytest.raises(ValueError, match=r"layer_or_weight: weight \(dtype torch.float32.*not quantized"):
        nosave_linear(torch.randn(2, IN), plain)
    assert not is_quantized(plain)
    unquantized = bnb.nn.Linear4bit(IN, OUT, quant_type="nf4")  # not moved to a device: not quantized yet
    with pytest.raises(ValueError, match="not quantized"):
        nosave_linear(torch.randn(2, IN), unquantized)
    with pytest.raises(TypeError, match="layer_or_weight must be"):
        nosave_linear(torch.randn(2, IN), "weight")
    layer = make_layer("nf4", False, torch.float32)
    with pytest.raises(ValueError, match=f"x has {IN + 1} features.*expects {IN}"):
        nosave_linear(torch.randn(2, IN + 1), layer)
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        nosave_linear(torch.ones(2, IN, dtype=torch.long), layer)
    with pytest.raises(ValueError, match="compute_dtype=torch.float64 is not supported"):
        nosave_linear(torch.randn(2, IN), layer, compute_dtype=torch.float64)
    layer8 = make_layer("int8", False, torch.float32)
    layer8.weight.SCB = None
    with pytest.raises(ValueError, match="int8 weight without SCB"):
        nosave_linear(torch.randn(2, IN), layer8)


def test_cpu_inference_packing_is_refused():
    layer = make_layer("nf4", False, torch.float32)
    layer.weight.quant_state.packing_format_for_cpu = True
    with pytest.raises(ValueError, match="CPU inference packing"):
        nosave_linear(torch.randn(2, IN), layer)


def test_odd_shapes_and_a_single_row():
    layer = bnb.nn.Linear4bit(100, 3, bias=True, quant_type="nf4", compute_dtype=torch.float32).to("cpu")
    x = torch.randn(1, 100, requires_grad=True)
    out, gx, _ = _run(lambda t: nosave_linear(t, layer), x, None)
    w = dequantize_weight(layer, torch.float32).double()
    ref, gref, _ = _run(lambda t: torch.nn.functional.linear(t.double(), w, layer.bias.double()).float(), x, None)
    _close(out, ref, torch.float32)
    _close(gx, gref, torch.float32)
    assert math.prod(w.shape) == 300


def test_module_export():
    assert nosave_matmul.nosave_linear is nosave_linear


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_matches_reference(mode, dtype):
    if mode == "int8":
        dtype = torch.float16
    layer = make_layer(mode, True, dtype, device="cuda")
    x = _input(3, dtype, device="cuda")
    ours = _run(lambda t: nosave_linear(t, layer), x, layer.bias)
    w = dequantize_weight(layer, torch.float32).double()
    ref = _run(lambda t: torch.nn.functional.linear(t.double(), w, layer.bias.double()).to(t.dtype), x, layer.bias)
    for a, b in zip(ours, ref):
        _close(a, b, dtype)
    theirs = _run(layer, x, layer.bias)
    # bitsandbytes multiplies in int8 on CUDA (activations quantized too): compare loosely there
    loose = 5e-2 if mode == "int8" else TOL[dtype]
    for a, b in zip(ours[:2], theirs[:2]):
        assert (a.double() - b.double()).abs().max().item() <= loose * (b.abs().max().item() + 1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_forward_retains_zero_new_bytes(mode):
    dtype = torch.float16 if mode == "int8" else torch.bfloat16
    layer = make_layer(mode, True, dtype, device="cuda")
    base = torch.randn(8, 64, IN, device="cuda", dtype=dtype, requires_grad=True)
    nosave_linear(base, layer).sum().backward()  # warm-up: cuBLAS workspaces, kernels
    x = base * 1.0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = nosave_linear(x, layer)
    del x
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before == out.untyped_storage().nbytes() - base.numel() * 2


@pytest.mark.parametrize("quant_type,dq", [("nf4", False), ("fp4", True)])
def test_backward_dequantizes_row_slices_only(quant_type, dq):
    """The input gradient needs the dense weight one slice of rows at a time, not whole."""
    import bitsandbytes as bnb

    from lightning_memkit.memory import LivePeak
    from lightning_memkit.ops import nosave_matmul as nm

    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(512, 256, bias=False, quant_type=quant_type, compress_statistics=dq,
                              compute_dtype=torch.float32)
    layer = layer.to("cpu")
    layer.weight = bnb.nn.Params4bit(torch.randn(256, 512) * 0.05, requires_grad=False, quant_type=quant_type,
                                     compress_statistics=dq)._quantize("cpu")
    x = torch.randn(8, 512, requires_grad=True)
    y = nm.nosave_linear(x, layer)
    g = torch.randn_like(y)
    with LivePeak() as lp:
        y.backward(g)
    dense = nm.dequantize_weight(layer, torch.float32)
    torch.testing.assert_close(x.grad, g @ dense, rtol=1e-5, atol=1e-5)
    weight_bytes = 256 * 512 * 4
    grad_bytes = 8 * 512 * 4
    # grad_x plus one slice (1/8 of the rows) and small absmax temporaries, never the whole weight
    assert nm.BACKWARD_CHUNKS == 8
    assert lp.peak_bytes < grad_bytes + weight_bytes // 4


def _decode_4bit(layer) -> torch.Tensor:
    """The layer's packed weight decoded in float64 from its bytes, independently of bitsandbytes' kernels."""
    qs = layer.weight.quant_state
    packed = layer.weight.data.reshape(-1)
    n = math.prod(qs.shape)
    nibbles = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n].long()
    absmax = qs.absmax.double()
    if qs.nested:
        blocks = torch.arange(absmax.numel()) // qs.state2.blocksize
        absmax = qs.state2.code.double()[qs.absmax.long()] * qs.state2.absmax.double()[blocks] + qs.offset
    return (qs.code.double()[nibbles] * absmax.repeat_interleave(qs.blocksize)[:n]).reshape(qs.shape)


@pytest.mark.parametrize("mode", ["nf4", "nf4-dq", "fp4"])
@pytest.mark.parametrize("in_features", [32, 96])
def test_rows_shorter_or_longer_than_a_block_decode_exactly(mode, in_features):
    """Blocks of 64 elements straddle rows of 32 or 96 columns; the result is the stored bytes, exactly."""
    layer = bnb.nn.Linear4bit(in_features, 48, bias=True, quant_type=mode[:3], compress_statistics=mode.endswith("-dq"),
                              compute_dtype=torch.float32)
    original = layer.weight.data.clone()
    layer = layer.to("cpu")
    decoded = _decode_4bit(layer)
    torch.testing.assert_close(dequantize_weight(layer, torch.float32).double(), decoded, rtol=1e-6, atol=1e-6)
    assert (decoded - original.double()).abs().max() <= 0.3 * original.abs().max()  # a quantization of it
    x = torch.randn(5, in_features, requires_grad=True)
    out, gx, _ = _run(lambda t: nosave_linear(t, layer), x, None)
    ref, gref, _ = _run(lambda t: torch.nn.functional.linear(t.double(), decoded, layer.bias.double()).float(), x,
                        None)
    _close(out, ref, torch.float32)
    _close(gx, gref, torch.float32)
