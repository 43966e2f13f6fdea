"""Liger-Kernel's fused linear cross-entropy test cases and tolerances, on CPU: ``linear_cross_entropy`` against
Liger's ground truth (the head in the inputs' dtype, float32 logits, softcap, torch's cross-entropy plus its z-loss),
with Liger's shapes, option sets, ignored targets and ``atol``/``rtol`` per dtype and reduction, compared as its
``assert_verbose_allclose`` compares (``|ref - ours| <= atol + rtol * |ours|``, NaN and inf in the same places).
The cases are rebuilt here from the suite's description; Liger is not imported. The fast suite runs Liger's small
shape, the slow suite its (8, 128, 1024, 4096) one too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_memkit.ops import linear_cross_entropy

SMALL, LARGE = (4, 47, 31, 123), (8, 128, 1024, 4096)
SHAPES = [pytest.param(*LARGE, marks=pytest.mark.slow), SMALL]
REDUCTIONS = [  # (reduction, dtype, atol, rtol): Liger's
    ("mean", torch.bfloat16, 5e-3, 5e-2),
    ("mean", torch.float32, 1e-5, 5e-4),
    ("sum", torch.bfloat16, 5e-0, 5e1),
    ("sum", torch.float32, 1e-3, 5e-2),
]
OPTIONS = [  # (class weights, label smoothing, ignore_index, z-loss, softcap, return_z_loss, accum_dtype)
    (False, 0.0, -100, 0.0, None, False, None),
    (True, 0.1, 42, 1e-4, 30.0, True, torch.float32),
]


def _close(ref: torch.Tensor, ours: torch.Tensor, atol: float, rtol: float) -> None:
    """Liger's ``assert_verbose_allclose(ref, ours)``."""
    assert ref.shape == ours.shape
    ref, ours = ref.double(), ours.double()
    bad = (ref - ours).abs() > atol + rtol * ours.abs()
    bad |= torch.isnan(ref) ^ torch.isnan(ours)
    bad |= torch.isposinf(ref) ^ torch.isposinf(ours)
    bad |= torch.isneginf(ref) ^ torch.isneginf(ours)
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements differ; max |diff| {(ref - ours).abs().max()}"


def _reference(x, w, b, t, *, ce_weight=None, ignore_index=-100, z_loss=0.0, smoothing=0.0, reduction="mean",
               softcap=None):
    """Liger's ``TorchLMHeadCE``: the head in the inputs' dtype, float32 logits, softcap, torch's loss + its z-loss."""
    logits = F.linear(x, w, b)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    ce = F.cross_entropy(logits, t, weight=ce_weight, reduction=reduction, label_smoothing=smoothing,
                         ignore_index=ignore_index)
    kept = t != ignore_index
    z = torch.where(kept, z_loss * torch.logsumexp(logits, -1) ** 2, 0.0)
    z = z.sum() / kept.sum() if reduction == "mean" else z.sum() if reduction == "sum" else z
    return ce + z, z


def _setup(shape, dtype, bias: bool, ignore_index: int, seed: int = 0):
    """Liger's inputs: ``rand`` head weights and bias, ``randn`` hidden states, a random number of ignored targets."""
    b_, t_, h, v = shape
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(v, h, generator=g).to(dtype)
    bb = torch.rand(v, generator=g).to(dtype) if bias else None
    x = torch.randn(b_ * t_, h, generator=g).to(dtype)
    t = torch.randint(0, v, (b_ * t_,), generator=g)
    count = int(torch.randint(1, b_ * t_ // 2, (1,), generator=g))
    t[torch.randperm(b_ * t_, generator=g)[:count]] = ignore_index
    return x, w, bb, t


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("B,T,H,V", SHAPES)
@pytest.mark.parametrize("reduction,dtype,atol,rtol", REDUCTIONS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("has_weight,smoothing,ignore_index,z_loss,softcap,return_z_loss,accum_dtype", OPTIONS)
def test_correctness(B, T, H, V, reduction, dtype, atol, rtol, bias, has_weight, smoothing, ignore_index, z_loss,
                     softcap, return_z_loss, accum_dtype):
    x, w, b, t = _setup((B, T, H, V), dtype, bias, ignore_index)
    ce_weight = torch.rand(V, generator=torch.Generator().manual_seed(1)) if has_weight else None
    opts = dict(ignore_index=ignore_index, z_loss=z_loss, smoothing=smoothing, reduction=reduction, softcap=softcap)
    x1, w1, b1 = _leaves(x, w, b)
    ref, ref_z = _reference(x1, w1, b1, t, ce_weight=ce_weight, **opts)
    x2, w2, b2 = _leaves(x, w, b)
    out = linear_cross_entropy(x2, w2, t, bias=b2, class_weights=ce_weight, ignore_index=ignore_index,
                               z_loss=z_loss, label_smoothing=smoothing, reduction=reduction, softcap=softcap,
                               return_z_loss=return_z_loss, accum_dtype=accum_dtype)
    ours, ours_z = out if return_z_loss else (out, None)
    _close(ref, ours, atol, rtol)
    if return_z_loss:
        _close(ref_z, ours_z, atol, rtol)
    ref.backward(torch.ones_like(ref))
    ours.backward(torch.ones_like(ours))
    for a, c in ((x1, x2), (w1, w2), (b1, b2)):
        if a is not None:
            _close(a.grad, c.grad, atol, rtol)


@pytest.mark.parametrize("B,T,H,V", SHAPES)
@pytest.mark.parametrize("reduction,dtype,atol,rtol", REDUCTIONS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("has_weight,smoothing,ignore_index,z_loss,softcap,return_z_loss,accum_dtype", OPTIONS)
def test_correctness_with_forward_only(B, T, H, V, reduction, dtype, atol, rtol, bias, has_weight, smoothing,
                                       ignore_index, z_loss, softcap, return_z_loss, accum_dtype):
    x, w, b, t = _setup((B, T, H, V), dtype, bias, ignore_index)
    ce_weight = torch.rand(V, generator=torch.Generator().manual_seed(1)) if has_weight else None
    with torch.no_grad():
        ref, ref_z = _reference(x, w, b, t, ce_weight=ce_weight, ignore_index=ignore_index, z_loss=z_loss,
                                smoothing=smoothing, reduction=reduction, softcap=softcap)
        out = linear_cross_entropy(*_leaves(x, w), t, bias=b, class_weights=ce_weight, ignore_index=ignore_index,
                                   z_loss=z_loss, label_smoothing=smoothing, reduction=reduction, softcap=softcap,
                                   return_z_loss=True, accum_dtype=accum_dtype)
    _close(ref, out[0], atol, rtol)
    if return_z_loss:
        _close(ref_z, out[1], atol, rtol)
    assert not out[0].requires_grad  # built under no_grad: nothing to differentiate, as Liger's "does not require grad"
    with pytest.raises(RuntimeError, match="does not require grad"):
        out[0].backward(torch.rand_like(out[0]))


@pytest.mark.parametrize("B,T,H,V", [(2, 2, 8, 8), (9, 7, 41, 41)])
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.bfloat16, 5e-3, 5e-2), (torch.float32, 1e-5, 5e-4)])
@pytest.mark.parametrize("has_weight", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_correctness_functional(B, T, H, V, dtype, atol, rtol, has_weight, bias):
    """Liger's functional case (signed class weights, z-loss 1e-4, smoothing 0.1, softcap 30, float32 accumulation,
    a random upstream gradient; Liger compares two entry points of its op), here against a float64 oracle of the
    same inputs with Liger's tolerances."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(B * T, H, generator=g)).to(dtype)
    t = torch.randint(0, V, (B * T,), generator=g)
    w = torch.randn(V, H, generator=g).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    ce_weight = torch.randn(V, generator=g) if has_weight else None
    x1, x2 = _leaves(x.double(), x)
    opts = dict(ignore_index=-100, z_loss=1e-4, smoothing=0.1, reduction="mean", softcap=30.0)
    ref, ref_z = _reference(x1, w.double(), None if b is None else b.double(), t,
                            ce_weight=None if ce_weight is None else ce_weight.double(), **opts)
    ours, ours_z = linear_cross_entropy(x2, w, t, bias=b, class_weights=ce_weight, z_loss=1e-4, label_smoothing=0.1,
                                        softcap=30.0, return_z_loss=True, accum_dtype=torch.float32)
    _close(ref, ours, atol, rtol)
    _close(ref_z, ours_z, atol, rtol)
    go = torch.randn((), generator=g)
    ref.backward(go.double())
    ours.backward(go)
    _close(x1.grad, x2.grad, atol, rtol)


@pytest.mark.parametrize("B,T,H,V", SHAPES)
@pytest.mark.parametrize("reduction,dtype,atol,rtol", REDUCTIONS[:2])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("return_token_accuracy", [True, False])
def test_correctness_with_token_accuracy(B, T, H, V, reduction, dtype, atol, rtol, bias, return_token_accuracy):
    x, w, b, t = _setup((B, T, H, V), dtype, bias, -100)
    x1, w1, b1 = _leaves(x, w, b)
    ref, _ = _reference(x1, w1, b1, t, reduction=reduction)
    x2, w2, b2 = _leaves(x, w, b)
    out = linear_cross_entropy(x2, w2, t, bias=b2, reduction=reduction, return_accuracy=return_token_accuracy)
    ours = out[0] if return_token_accuracy else out
    if return_token_accuracy:
        with torch.no_grad():
            logits = F.linear(x, w, b)  # Liger's expected accuracy: the argmax of the head in the inputs' dtype
            kept = t != -100
            expected = ((logits.argmax(-1) == t) & kept).sum().float() / kept.sum().float()
        _close(expected, out[1], atol, rtol)
    _close(ref, ours, atol, rtol)
    ref.backward()
    ours.backward()
    for a, c in ((x1, x2), (w1, w2), (b1, b2)):
        if a is not None:
            _close(a.grad, c.grad, atol, rtol)


@pytest.mark.parametrize("B,T,H,V", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cast_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("accum_dtype", [None, torch.float32])
def test_amp(B, T, H, V, bias, cast_dtype, accum_dtype):
    atol, rtol = 5e-3, 5e-2
    x, w, b, t = _setup((B, T, H, V), torch.float32, bias, -100)
    t[t == -100] = 0  # Liger's AMP case ignores no target
    x1, w1, b1 = _leaves(x, w, b)
    x2, w2, b2 = _leaves(x, w, b)
    with torch.autocast("cpu", dtype=cast_dtype):
        ref, _ = _reference(x1, w1, b1, t)
        ours = linear_cross_entropy(x2, w2, t, bias=b2, accum_dtype=accum_dtype)
    _close(ref, ours, atol, rtol)
    ref.backward()
    ours.backward()
    _close(x1.grad, x2.grad, atol, rtol)
    _close(w1.grad, w2.grad, atol, rtol)


def _scaled_reference(x, w, b, t, reduction):
    """Liger's token-scaling ground truth: torch's per-token loss times the target's detached softmax probability."""
    logits = F.linear(x, w, b)
    ce = F.cross_entropy(logits, t, ignore_index=-100, reduction="none")
    p = torch.softmax(logits.detach(), -1).gather(1, t.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    scaled = ce * torch.where(t != -100, p, 0.0)
    return scaled.sum() if reduction == "sum" else scaled


@pytest.mark.parametrize("reduction,atol,rtol", [("none", 1e-4, 1e-4), ("sum", 1e-5, 1e-5)])
@pytest.mark.parametrize("seed", [0, 1])
def test_correctness_token_scaling(reduction, atol, rtol, seed):
    """Liger's token-scaling cases (B, T, H, V = 2, 4, 8, 16, float32, with a bias): loss and input gradient."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 8, generator=g)
    t = torch.randint(0, 16, (8,), generator=g)
    w = torch.randn(16, 8, generator=g)
    b = torch.randn(16, generator=g)
    x1, x2 = _leaves(x, x)
    ref = _scaled_reference(x1, w, b, t, reduction)
    ours = linear_cross_entropy(x2, w, t, bias=b, reduction=reduction, token_scaling=True)
    assert torch.allclose(ours, ref, atol=atol, rtol=rtol)
    ref.sum().backward()
    ours.sum().backward()
    assert torch.allclose(x2.grad, x1.grad, atol=atol, rtol=rtol)


def test_token_scaling_with_ignore_index():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 8, generator=g, requires_grad=True)
    t = torch.tensor([0, 100, -100, 500, -100, 999])
    w, b = torch.randn(1000, 8, generator=g), torch.randn(1000, generator=g)
    loss = linear_cross_entropy(x, w, t, bias=b, reduction="sum", token_scaling=True)
    assert loss.numel() == 1 and torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[[2, 4]] == 0).all()  # ignored tokens take no gradient
    ref = _scaled_reference(x.detach(), w, b, t, "sum")
    assert torch.allclose(loss, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("return_z_loss,return_token_accuracy", [(False, False), (True, False), (False, True),
                                                                  (True, True)])
def test_structured_output(return_z_loss, return_token_accuracy):
    hidden = torch.tensor([[0.2, -0.1], [1.0, 0.5], [-0.3, 0.7]], requires_grad=True)
    weight = torch.tensor([[0.5, -0.4], [-0.2, 0.3], [0.1, 0.6]])
    bias = torch.tensor([0.1, -0.2, 0.05])
    targets = torch.tensor([0, 1, 2])
    out = linear_cross_entropy(hidden, weight, targets, bias=bias, return_z_loss=return_z_loss,
                               return_accuracy=return_token_accuracy)
    logits = hidden.detach() @ weight.T + bias
    expected = F.cross_entropy(logits, targets)
    if not (return_z_loss or return_token_accuracy):
        assert isinstance(out, torch.Tensor)
        assert torch.allclose(out, expected, atol=1e-6)
        return
    assert isinstance(out, tuple) and len(out) == 1 + return_z_loss + return_token_accuracy
    assert torch.allclose(out[0], expected, atol=1e-6)
    if return_token_accuracy:  # the accuracy comes before the z-loss
        assert torch.allclose(out[1], (logits.argmax(-1) == targets).float().mean(), atol=1e-6)
    if return_z_loss:
        assert float(out[-1]) == 0.0  # no z-loss coefficient: the term is 0
    out[0].backward()
    assert hidden.grad is not None


@pytest.mark.parametrize("B,T,H,V", SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.bfloat16, 5e-3, 5e-2), (torch.float32, 1e-5, 5e-4)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_correctness_with_predicted_tokens(B, T, H, V, dtype, atol, rtol, bias, ignore_index):
    g = torch.Generator().manual_seed(42)
    w = torch.randn(V, H, generator=g).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    x = torch.randn(B * T, H, generator=g).to(dtype).requires_grad_(True)
    t = torch.randint(0, V, (B * T,), generator=g)
    t[torch.randperm(B * T, generator=g)[: B * T // 4]] = ignore_index
    loss, predicted = linear_cross_entropy(x, w, t, bias=b, ignore_index=ignore_index, return_predicted_tokens=True)
    assert predicted.shape == (B * T,) and predicted.dtype == torch.int64
    kept = t != ignore_index
    with torch.no_grad():  # Liger compares logit values: chunked products may break ties differently
        logits = x.float() @ w.float().T + (0 if b is None else b.float())
        best = logits[kept].max(-1).values
        chosen = logits[kept].gather(1, predicted[kept].unsqueeze(1)).squeeze(1)
    assert torch.allclose(chosen, best, atol=atol, rtol=rtol)
    assert (predicted[~kept] == -1).all()
    loss.backward()
    assert x.grad is not None


@pytest.mark.parametrize("B,T,H,V", [(2, 16, 32, 64), (1, 32, 64, 128)])
@pytest.mark.parametrize("bias", [True, False])
def test_reduction_none_per_token_grad_output(B, T, H, V, bias):
    g = torch.Generator().manual_seed(42)
    x = torch.randn(B * T, H, generator=g) * 0.1
    w = torch.randn(V, H, generator=g) * 0.1
    b = torch.randn(V, generator=g) * 0.1 if bias else None
    t = torch.randint(0, V, (B * T,), generator=g)
    go = torch.rand(B * T, generator=g) + 0.5  # a non-uniform upstream gradient
    x1, w1, b1 = _leaves(x, w, b)
    ref = F.cross_entropy(F.linear(x1, w1, b1), t, reduction="none")
    ref.backward(go)
    x2, w2, b2 = _leaves(x, w, b)
    ours = linear_cross_entropy(x2, w2, t, bias=b2, reduction="none")
    ours.backward(go)
    _close(ref, ours, 1e-4, 1e-4)
    for a, c in ((x1, x2), (w1, w2), (b1, b2)):
        if a is not None:
            _close(a.grad, c.grad, 1e-4, 1e-4)
