import pytest
import torch
import torch.nn.functional as F
from cross_entropy_oracle import OPTION_SETS, NoHostSync, assert_within, make_target, reference_loss

from lightning_memkit.memory import LivePeak
from lightning_memkit.ops import linear_cross_entropy

TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}  # relative to the oracle's largest magnitude
N, H, V = 37, 24, 301  # neither N nor V a multiple of any block or chunk


def _inputs(dtype, bias, n=N, h=H, v=V):
    x = torch.randn(n, h).to(dtype)
    w = (torch.randn(v, h) * 2 / h**0.5).to(dtype)
    b = torch.randn(v).to(dtype) if bias else None
    return x, w, b, make_target(n, v)


def _leaves(x, w, b, dtype=None):
    conv = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t.clone())
    return [None if t is None else conv(t).requires_grad_() for t in (x, w, b)]


def _reference(x, w, b, target, reduction, opts):
    return reference_loss(F.linear(x, w, b), target, reduction=reduction, **opts)


# one-row chunks with fp32 accumulation: 37 bf16 roundings of dW would exceed torch's error (see the docstring
# of accum_dtype); the bf16 default is held to 1.5x torch chunked's error at 8 chunks below
CHUNKING = {"rows8": {"chunk_size": 8}, "auto": {}, "one_row_chunks": {"chunk_bytes": 1, "accum_dtype": torch.float32}}


@pytest.mark.parametrize("chunking", list(CHUNKING))
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("opts", ["plain", "smoothing", "all"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_fp64_oracle(dtype, reduction, opts, bias, chunking):
    """Every dtype, reduction, option set (smoothing, z-loss, softcap) and chunking scheme: 8-row chunks, the
    auto rule, and a tiny budget (one-row chunks, 16-row weight slabs on the CPU bf16 path, fp32 accumulation)."""
    opts = OPTION_SETS[opts]
    x, w, b, target = _inputs(dtype, bias)
    oracle_leaves = _leaves(x, w, b, torch.float64)
    oracle = _reference(*oracle_leaves, target, reduction, opts)
    grad_out = torch.rand_like(oracle) + 0.5
    oracle.backward(grad_out)
    ref_leaves = _leaves(x, w, b)
    ref = _reference(*ref_leaves, target, reduction, opts)
    ref.backward(grad_out.to(dtype))
    our_leaves = _leaves(x, w, b)
    chunks = CHUNKING[chunking]
    if dtype == torch.bfloat16 and chunking == "rows8":  # 5 bf16 roundings of dW: held to 1.5x torch chunked's
        chunks = {**chunks, "accum_dtype": torch.float32}  # error in test_bf16_default_error_is_within_1_5x_...
    ours = linear_cross_entropy(our_leaves[0], our_leaves[1], target, bias=our_leaves[2], reduction=reduction,
                                **chunks, **opts)
    assert ours.dtype == torch.float32 and ours.shape == oracle.shape  # float32 losses, as the peers return
    ours.backward(grad_out.to(ours.dtype))
    assert_within(ours.detach(), ref.detach(), oracle.detach(), TOL[dtype], "loss")
    for name, o, r, q in zip(("dx", "dW", "db"), our_leaves, ref_leaves, oracle_leaves):
        if q is not None:
            assert o.grad.dtype == dtype
            assert_within(o.grad, r.grad, q.grad, TOL[dtype], name)


def test_3d_hidden_partial_grads_and_auto_chunk():
    x, w, _, _ = _inputs(torch.float32, False)
    h = x.reshape(1, N, H).expand(2, N, H).contiguous().requires_grad_()
    target = make_target(2 * N, V, 2, N)
    w_frozen = w.clone()  # no gradient wanted for the weight
    loss = linear_cross_entropy(h, w_frozen, target, z_loss=0.02)
    loss.backward()
    h_ref = h.detach().clone().requires_grad_()
    _reference(h_ref, w_frozen, None, target, "mean", {"z_loss": 0.02}).backward()
    assert torch.allclose(h.grad, h_ref.grad, atol=1e-6) and w_frozen.grad is None


def test_reduction_none_recomputes_and_supports_retain_graph():
    x, w, b, target = _inputs(torch.float32, True)
    leaves = _leaves(x, w, b)
    loss = linear_cross_entropy(leaves[0], leaves[1], target, bias=leaves[2], reduction="none", chunk_size=5)
    g = torch.randn(N)  # per-token upstream gradients, some negative
    loss.backward(g, retain_graph=True)
    first = [t.grad.clone() for t in leaves]
    loss.backward(g)
    for t, f in zip(leaves, first):
        assert torch.allclose(t.grad, 2 * f)


def test_scalar_reduction_is_differentiable_once():
    x, w, _, target = _inputs(torch.float32, False)
    w = w.requires_grad_()
    loss = linear_cross_entropy(x, w, target, chunk_size=8)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="differentiated once"):
        loss.backward()


def test_no_grad_does_no_gradient_work():
    x, w, _, target = _inputs(torch.float32, False)
    w.requires_grad_()
    with torch.no_grad(), LivePeak() as lp:
        loss = linear_cross_entropy(x, w, target, chunk_size=8)
    assert loss.grad_fn is None
    assert lp.peak_bytes < V * H * 4  # no dW buffer
    assert torch.allclose(loss, _reference(x, w, None, target, "mean", {}), atol=1e-5)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_no_host_sync_without_validation(reduction):
    x, w, b, target = _inputs(torch.float32, True)
    leaves = _leaves(x, w, b)
    with NoHostSync():
        loss = linear_cross_entropy(leaves[0], leaves[1], target, bias=leaves[2], reduction=reduction,
                                    chunk_size=8, softcap=3.0, validate=False)
        loss.sum().backward()
    ref_leaves = _leaves(x, w, b)
    ref = _reference(*ref_leaves, target, reduction, {"softcap": 3.0})
    ref.sum().backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-5, atol=1e-5)
    for name, ours, theirs in zip(("dx", "dW", "db"), leaves, ref_leaves):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_peak_memory_is_gradients_plus_one_chunk():
    n, h, v, rows = 512, 64, 2000, 16
    x = torch.randn(n, h, requires_grad=True)
    w = (torch.randn(v, h) / h**0.5).requires_grad_()
    target = make_target(n, v)
    grads = (v * h + n * h) * 4  # dW + dx: unavoidable
    chunk = rows * v * 4
    peaks = {}
    for name, fn in {
        "ours": lambda: linear_cross_entropy(x, w, target, chunk_size=rows),
        "ours_2x": lambda: linear_cross_entropy(x, w, target, chunk_size=2 * rows),
        "torch_chunked": lambda: F.linear_cross_entropy(
            x, w, target, options=torch.nn.LinearCrossEntropyOptions(batch_chunk_size=rows)),
        "torch": lambda: F.cross_entropy(F.linear(x, w), target),
    }.items():
        x.grad = w.grad = None
        with LivePeak() as lp:
            fn().backward()
        peaks[name] = lp.peak_bytes
    small = 16 * n * 4 + 4096  # per-token fp32/int64 vectors and scalars
    assert grads + chunk <= peaks["ours"] <= grads + chunk + small
    # chunk_size is honoured: twice the rows, one more chunk of fp32 logits (+ per-row vectors)
    assert chunk <= peaks["ours_2x"] - peaks["ours"] <= chunk + 64 * rows
    # the goal of the feature: overhead above dW + dx at most 1/4 of torch chunked's
    assert peaks["ours"] - grads <= (peaks["torch_chunked"] - grads) / 4
    assert peaks["torch"] > n * v * 4  # the materialized logits


def _overhead(fn, x, w, grads):
    x.grad = w.grad = None
    with LivePeak() as lp:
        fn().sum().backward()
    return lp.peak_bytes - grads


@pytest.mark.parametrize("reduction, fraction, h", [("mean", 1 / 5, 256), ("mean", 1 / 5, 512), ("none", 1 / 8, 256)])
def test_auto_chunk_is_a_fraction_of_the_gradients(reduction, fraction, h):
    n, v = 1200, 16000
    x = torch.randn(n, h, requires_grad=True)
    w = (torch.randn(v, h) / h**0.5).requires_grad_()
    target = make_target(n, v)
    grads = (v * h + n * h) * 4
    rows = int(fraction * grads) // (v * 4)
    if rows >= 32:  # multiples of 16 from 32 rows up
        rows -= rows % 16
    # the scalar reductions: at least 448 rows (tall GEMMs) where 448 rows of logits cost at most dW + dx (H=512
    # here: 28.7 MB against 35.2 MB; H=256: against 17.6 MB, so the chunk stays at the budget, 48 rows)
    if reduction != "none" and 448 * v * 4 <= grads:
        rows = max(rows, 448)
    assert rows == {256: 32 if reduction == "none" else 48, 512: 448}[h]
    small = 16 * n * 4 + 2 * v * 4 + 4096  # per-token and per-class vectors and scalars
    overhead = _overhead(lambda: linear_cross_entropy(x, w, target, reduction=reduction), x, w, grads)
    assert rows * v * 4 <= overhead <= rows * v * 4 + small


def test_auto_chunk_of_a_narrow_head_is_a_fifth_of_the_gradients():
    """The benchmark's narrow-head case (N=2048 H=256 V=16,384 fp32, 20% of targets ignored): 448 rows of logits
    (28 MiB) would cost more than dW + dx (18 MiB), so the chunk is the budget's 48 rows (3 MiB), under a quarter of
    the second dW + dx that torch's chunked path allocates."""
    from lightning_memkit.ops._cross_entropy_common import CrossEntropyOptions
    from lightning_memkit.ops.linear_cross_entropy import chunk_plan

    n, h, v = 2048, 256, 16384
    x = torch.randn(n, h, requires_grad=True)
    w = (torch.randn(v, h) / h**0.5).requires_grad_()
    target = make_target(n, v, ignore_frac=0.2)
    grads = (v * h + n * h) * 4  # 18 MiB
    assert chunk_plan(x, w, n, CrossEntropyOptions(), "torch", "auto", None).rows == 48
    overhead = _overhead(lambda: linear_cross_entropy(x, w, target), x, w, grads)
    assert 48 * v * 4 <= overhead <= 48 * v * 4 + 16 * n * 4 + 4096  # 3 MiB of logits + per-token vectors
    assert overhead <= grads / 4


def test_auto_chunk_takes_at_most_a_quarter_of_free_memory(monkeypatch):
    import importlib

    lce_module = importlib.import_module("lightning_memkit.ops.linear_cross_entropy")

    n, h, v = 1200, 512, 16000  # the 448-row floor applies (see above), but a quarter of the free memory holds 48
    x = torch.randn(n, h, requires_grad=True)
    w = (torch.randn(v, h) / h**0.5).requires_grad_()
    target = make_target(n, v)
    grads = (v * h + n * h) * 4
    monkeypatch.setattr(lce_module, "free_device_memory", lambda device: 48 * v * 4 * 4)  # room for 48 rows
    overhead = _overhead(lambda: linear_cross_entropy(x, w, target), x, w, grads)
    assert 48 * v * 4 <= overhead <= 48 * v * 4 + 16 * n * 4 + 2 * v * 4 + 4096


def test_chunk_bytes_overrides_the_budget():
    n, h, v = 300, 80, 16000
    x = torch.randn(n, h, requires_grad=True)
    w = (torch.randn(v, h) / h**0.5).requires_grad_()
    target = make_target(n, v)
    grads = (v * h + n * h) * 4
    overhead = _overhead(lambda: linear_cross_entropy(x, w, target, chunk_bytes=48 * v * 4 + 100), x, w, grads)
    assert 48 * v * 4 <= overhead <= 48 * v * 4 + 16 * n * 4 + 2 * v * 4 + 4096
    with pytest.raises(ValueError, match="not both"):
        linear_cross_entropy(x, w, target, chunk_size=8, chunk_bytes=2**20)
    with pytest.raises(ValueError, match="chunk_bytes"):
        linear_cross_entropy(x, w, target, chunk_bytes=0)


def test_bf16_on_cpu_runs_fp32_matmuls_in_weight_slabs():
    """float32 logits of bf16 inputs on a CPU: many weight slabs (a tiny budget) and the whole-weight fp32
    accumulator agree with the oracle."""
    x, w, b, target = _inputs(torch.bfloat16, True, n=64, v=301)
    oracle_leaves = _leaves(x, w, b, torch.float64)
    _reference(*oracle_leaves, target, "mean", {}).backward()
    for kwargs in ({"chunk_bytes": 1}, {"chunk_size": 16, "accum_dtype": torch.float32}):
        leaves = _leaves(x, w, b)
        linear_cross_entropy(leaves[0], leaves[1], target, bias=leaves[2], logits_dtype=torch.float32,
                             **kwargs).backward()
        for name, o, q in zip(("dx", "dW", "db"), leaves, oracle_leaves):
            assert o.grad.dtype == torch.bfloat16, name
            torch.testing.assert_close(o.grad.double(), q.grad, rtol=2e-2, atol=2e-3, msg=name)


def test_bf16_default_error_is_within_1_5x_torch_chunked():
    """The default bf16 scheme (dW in bf16, each chunk's product rounded once) against an fp64 oracle."""
    torch.manual_seed(0)
    n, h, v = 512, 64, 4000
    x = torch.randn(n, h).bfloat16()
    w = (torch.randn(v, h) / h**0.5).bfloat16()
    target = make_target(n, v)
    oracle_leaves = _leaves(x, w, None, torch.float64)
    oracle = _reference(*oracle_leaves, target, "mean", {})
    oracle.backward()
    errors = {}
    for name, fn in {
        "ours": lambda a, b: linear_cross_entropy(a, b, target, chunk_size=64),
        "torch_chunked": lambda a, b: F.linear_cross_entropy(
            a, b, target, options=torch.nn.LinearCrossEntropyOptions(batch_chunk_size=64)),
    }.items():
        a, b_, _ = _leaves(x, w, None)
        loss = fn(a, b_)
        loss.backward()
        errors[name] = [(t.double() - q).abs().max().item()
                        for t, q in ((loss.detach(), oracle.detach()), (a.grad, oracle_leaves[0].grad),
                                     (b_.grad, oracle_leaves[1].grad))]
    for what, ours, theirs in zip(("loss", "dx", "dW"), errors["ours"], errors["torch_chunked"]):
        assert ours <= 1.5 * theirs, f"{what}: {ours:.3e} > 1.5 x torch chunked's {theirs:.3e}"


def test_runs_inside_torch_compile():
    x, w, b, target = _inputs(torch.float32, True)
    eager = _leaves(x, w, b)
    compiled = _leaves(x, w, b)

    def step(h, weight, bias):
        return 2.0 * linear_cross_entropy(torch.tanh(h), weight, target, bias=bias, chunk_size=8, validate=False)

    step(*eager).backward()
    torch.compile(step, backend="eager")(*compiled).backward()
    for a, c in zip(eager, compiled):
        assert torch.allclose(a.grad, c.grad, atol=1e-6)


def test_autocast_casts_like_f_linear():
    x, w, _, target = _inputs(torch.float32, False)
    ours, ref = _leaves(x, w, None), _leaves(x, w, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(ours[0], ours[1], target, chunk_size=8)
        ref_loss = F.cross_entropy(F.linear(ref[0], ref[1]), target)
    assert loss.dtype == ref_loss.dtype == torch.float32  # autocast runs cross-entropy in float32 too
    loss.backward()
    ref_loss.backward()
    assert ours[1].grad.dtype == torch.float32
    assert torch.allclose(loss.float(), ref_loss.float(), rtol=1e-2)
    assert torch.allclose(ours[1].grad, ref[1].grad, atol=2e-2 * ref[1].grad.abs().max().item())


def test_bad_inputs():
    x, w, b, target = _inputs(torch.float32, True)
    with pytest.raises(ValueError, match=r"target holds 301, outside \[0, 301\)"):
        linear_cross_entropy(x, w, torch.where(target == -100, V, target))
    with pytest.raises(ValueError, match=r"target shape \(36,\) must equal hidden shape"):
        linear_cross_entropy(x, w, target[:-1])
    with pytest.raises(ValueError, match=r"weight shape \(301, 23\) must be \(V, H\) with H = hidden.shape\[-1\] = 24"):
        linear_cross_entropy(x, w[:, :-1], target)
    with pytest.raises(ValueError, match=r"bias must have shape \(301,\)"):
        linear_cross_entropy(x, w, target, bias=b[:-1])
    with pytest.raises(TypeError, match="weight dtype torch.bfloat16 must equal hidden dtype torch.float32"):
        linear_cross_entropy(x, w.bfloat16(), target)
    with pytest.raises(ValueError, match=r"label_smoothing=2: must be a finite number >= 0 and <= 1"):
        linear_cross_entropy(x, w, target, label_smoothing=2)
    with pytest.raises(TypeError, match="accum_dtype must be None"):
        linear_cross_entropy(x, w, target, accum_dtype=torch.int32)


@pytest.mark.parametrize(("chunk_size", "err"), [(0, ValueError), (-3, ValueError), ("big", TypeError),
                                                 (2.5, TypeError), (True, TypeError)])
def test_bad_chunk_size(chunk_size, err):
    x, w, _, target = _inputs(torch.float32, False)
    with pytest.raises(err, match=r"chunk_size=.*: must be an int >= 1 or 'auto'"):
        linear_cross_entropy(x, w, target, chunk_size=chunk_size)


def test_empty_batch():
    w = torch.randn(V, H, requires_grad=True)
    x = torch.randn(0, H, requires_grad=True)
    target = torch.zeros(0, dtype=torch.long)
    assert linear_cross_entropy(x, w, target, reduction="sum").item() == 0.0
    assert torch.isnan(linear_cross_entropy(x, w, target))
    loss = linear_cross_entropy(x, w, target, reduction="none")
    assert loss.shape == (0,)


@pytest.mark.cuda
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_matches_oracle(dtype, reduction):
    n, h, v = 1031, 256, 32003
    x = torch.randn(n, h, device="cuda").to(dtype)
    w = (torch.randn(v, h, device="cuda") * 2 / h**0.5).to(dtype)
    b = torch.randn(v, device="cuda").to(dtype)
    target = make_target(n, v).cuda()
    opts = OPTION_SETS["all"]
    oracle_leaves = _leaves(x, w, b, torch.float64)
    oracle = _reference(*oracle_leaves, target, reduction, opts)
    grad_out = torch.rand_like(oracle) + 0.5
    oracle.backward(grad_out)
    ref_leaves = _leaves(x, w, b)
    _reference(*ref_leaves, target, reduction, opts).backward(grad_out.to(dtype))
    ref = _reference(*[t.detach() for t in ref_leaves], target, reduction, opts)
    our_leaves = _leaves(x, w, b)
    ours = linear_cross_entropy(our_leaves[0], our_leaves[1], target, bias=our_leaves[2], reduction=reduction,
                                chunk_size=256, **opts)
    ours.backward(grad_out.to(dtype))
    assert_within(ours.detach(), ref, oracle.detach(), TOL[dtype], "loss")
    for name, o, r, q in zip(("dx", "dW", "db"), our_leaves, ref_leaves, oracle_leaves):
        assert_within(o.grad, r.grad, q.grad, TOL[dtype], name)


def _bf16_step(fake: bool, reduction: str, accum_dtype, counter, logits_dtype=torch.float32) -> int:
    """The LivePeak bytes of a bf16 CPU forward and backward with many chunks and weight slabs (``chunk_bytes``
    small), on fake or real tensors; the ops' FLOPs go to ``counter``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    n, h, v = 96, 32, 1000
    with FakeTensorMode() if fake else torch.device("cpu"), LivePeak() as lp, counter:
        x = torch.zeros(n, h, dtype=torch.bfloat16, requires_grad=True)
        w = torch.zeros(v, h, dtype=torch.bfloat16, requires_grad=True)
        target = torch.zeros(n, dtype=torch.long)
        loss = linear_cross_entropy(x, w, target, reduction=reduction, chunk_bytes=40_000, accum_dtype=accum_dtype,
                                    logits_dtype=logits_dtype)
        loss.sum().backward()
        assert x.grad.shape == x.shape and w.grad.shape == w.shape
    return lp.peak_bytes


@pytest.mark.parametrize("reduction", ["mean", pytest.param("none", marks=pytest.mark.slow)])
@pytest.mark.parametrize("accum_dtype", [None, torch.float32], ids=["bf16_dw", "fp32_dw"])
@pytest.mark.parametrize("logits_dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16],
                         ids=["fp32_logits", "rounded_logits"])
def test_on_fake_tensors_the_slab_loops_are_one_product_with_the_same_bytes_and_flops(
        monkeypatch, reduction, accum_dtype, logits_dtype):
    """An estimate traces the CPU bf16 upcast path (float32 logits, or logits rounded to bf16 on a CPU without bf16
    matrix units) on fake tensors: one product per slab loop and one chunk of rows standing for the alike ones, the
    same storages (LivePeak's peak) and the same FLOPs as the loops on real tensors, which take dozens of slabs
    here."""
    import sys

    from torch.utils.flop_counter import FlopCounterMode

    from lightning_memkit.ops.linear_cross_entropy import chunk_plan

    monkeypatch.setattr(sys.modules["lightning_memkit.ops.linear_cross_entropy"], "native_half_matmul", lambda d: False)
    from lightning_memkit.estimate.fast_ops import FastOps

    real_flops, fake_flops = FlopCounterMode(display=False), FastOps()  # the estimate's counter: loops it ran once
    fake_flops.counting = True  # counted as often as they stand for (fake_repeat)
    real = _bf16_step(False, reduction, accum_dtype, real_flops, logits_dtype)
    fake = _bf16_step(True, reduction, accum_dtype, fake_flops, logits_dtype)
    assert fake == real
    assert fake_flops.flops == real_flops.get_total_flops() > 0
    x, w = torch.zeros(96, 32, dtype=torch.bfloat16), torch.zeros(1000, 32, dtype=torch.bfloat16)
    plan = chunk_plan(x, w, 96, type("O", (), {"reduction": reduction, "softcap": None})(), "torch", "auto", 40_000)
    assert 1000 / plan.slab > 10 and 96 / plan.rows > 2  # the loops the fake run does not take


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_half_inputs_give_float32_losses_not_rounded_to_their_dtype(reduction):
    """Per-token losses of 4 to 10 would lose up to 0.03 to bf16 rounding: the loss stays float32, every reduction,
    and a float64 accumulation gives a float64 loss."""
    x, w, _, target = _inputs(torch.bfloat16, False)
    loss = linear_cross_entropy(x, w, target, reduction=reduction)
    assert loss.dtype == torch.float32
    rows = linear_cross_entropy(x, w, target, reduction="none")
    assert (rows != rows.to(torch.bfloat16).float()).any()  # values bf16 cannot hold: never rounded to it
    assert linear_cross_entropy(x.float(), w.float(), target, accum_dtype=torch.float64).dtype == torch.float64
