"""linear_cross_entropy's peer options (class weights, shift, the log-sum-exp, token accuracy) and its two numerics
(logits rounded to the head's dtype as transformers computes them, or kept in float32), against references."""

import pytest
import torch
import torch.nn.functional as F
from cross_entropy_oracle import make_target

from lightning_memkit.ops import linear_cross_entropy

N, H, V = 37, 24, 301


def _inputs(dtype=torch.float32, n=N, h=H, v=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * 2 / h**0.5).to(dtype)
    return x, w, make_target(n, v, generator=g)


def _leaves(*tensors, dtype=None):
    return [t.to(dtype or t.dtype).clone().requires_grad_() for t in tensors]


def _liger_weighted(z, t, cw, eps, z_loss, reduction):
    """torch's weighted cross-entropy plus Liger-Kernel's unweighted z-loss (mean: over the kept tokens' count)."""
    valid = t != -100
    ce = F.cross_entropy(z, t, weight=cw, label_smoothing=eps, reduction="none")
    zl = z_loss * torch.logsumexp(z, -1) ** 2 * valid
    if reduction == "mean":
        return ce.sum() / cw[t[valid]].sum() + zl.sum() / valid.sum()
    if reduction == "sum":
        return ce.sum() + zl.sum()
    return ce + zl


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("eps", "z_loss"), [(0.0, 0.0), (0.2, 0.0), (0.1, 0.03)])
def test_class_weights_match_torch_weight_and_liger_z_loss(reduction, eps, z_loss):
    x, w, t = _inputs()
    cw = torch.rand(V, generator=torch.Generator().manual_seed(1)) * 2 + 0.1
    x64, w64 = _leaves(x, w, dtype=torch.float64)
    oracle = _liger_weighted(x64 @ w64.T, t, cw.double(), eps, z_loss, reduction)
    grad_out = torch.rand_like(oracle) + 0.5
    oracle.backward(grad_out)
    xs, ws = _leaves(x, w)
    ours = linear_cross_entropy(xs, ws, t, class_weights=cw, label_smoothing=eps, z_loss=z_loss,
                                reduction=reduction, chunk_size=8)
    ours.backward(grad_out.float())
    torch.testing.assert_close(ours.double(), oracle.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xs.grad.double(), x64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ws.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)


def test_unit_class_weights_change_nothing_and_bad_weights_are_refused():
    x, w, t = _inputs()
    plain = linear_cross_entropy(x, w, t, label_smoothing=0.1, z_loss=0.01)
    ones = linear_cross_entropy(x, w, t, label_smoothing=0.1, z_loss=0.01, class_weights=torch.ones(V))
    torch.testing.assert_close(ones, plain, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match=rf"class_weights must have shape \({V},\)"):
        linear_cross_entropy(x, w, t, class_weights=torch.ones(V - 1))
    with pytest.raises(TypeError, match="class_weights must be a floating-point tensor"):
        linear_cross_entropy(x, w, t, class_weights=torch.ones(V, dtype=torch.long))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_return_lse_gives_the_log_sum_exp_and_its_gradient_for_a_custom_z_loss(reduction):
    x, w, t = _inputs()
    b = torch.randn(V)
    x64, w64, b64 = _leaves(x, w, b, dtype=torch.float64)
    z = F.linear(x64, w64, b64)
    valid = t != -100
    ref_lse = torch.logsumexp(z, -1) * valid
    ref = F.cross_entropy(z, t, reduction=reduction)
    (ref.sum() + 1e-2 * (ref_lse**2).sum() + ref_lse.sum()).backward()
    xs, ws, bs = _leaves(x, w, b)
    loss, lse = linear_cross_entropy(xs, ws, t, bias=bs, reduction=reduction, return_lse=True, chunk_size=8)
    assert lse.shape == t.shape and lse.dtype == torch.float32 and torch.all(lse[~valid] == 0)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=1e-6, atol=1e-5)
    (loss.sum() + 1e-2 * (lse**2).sum() + lse.sum()).backward()
    for ours, oracle, name in ((xs, x64, "dx"), (ws, w64, "dW"), (bs, b64, "db")):
        torch.testing.assert_close(ours.grad.double(), oracle.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_gradient_of_the_lse_alone():
    x, w, t = _inputs()
    x64, w64 = _leaves(x, w, dtype=torch.float64)
    (torch.logsumexp(x64 @ w64.T, -1) * (t != -100)).sum().backward()
    xs, ws = _leaves(x, w)
    _, lse = linear_cross_entropy(xs, ws, t, return_lse=True, softcap=None)
    lse.sum().backward()
    torch.testing.assert_close(xs.grad.double(), x64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ws.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_token_accuracy_is_the_argmax_of_the_logits_over_kept_tokens(reduction, softcap):
    x, w, t = _inputs()
    t[:12] = (x[:12] @ w.T).argmax(-1)  # some hits for sure
    valid = t != -100
    hits = ((x @ w.T).argmax(-1) == t) & valid
    loss, acc = linear_cross_entropy(x, w, t, reduction=reduction, softcap=softcap, return_accuracy=True,
                                     chunk_size=8)
    expected = {"mean": hits.sum() / valid.sum(), "sum": hits.sum() / valid.sum(), "none": hits.float()}[reduction]
    assert acc.dtype == torch.float32 and not acc.requires_grad
    torch.testing.assert_close(acc, expected.float())
    assert 12 <= hits.sum() < valid.sum()
    every = torch.full_like(t, -100)
    assert float(linear_cross_entropy(x, w, every, reduction=reduction, return_accuracy=True)[1].sum()) == 0.0


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shift", [1, True, 3])
def test_shift_predicts_later_targets_as_cut_cross_entropy(reduction, shift):
    b, time = 3, 11
    x, w, _ = _inputs(n=b * time)
    x = x.reshape(b, time, H)
    labels = torch.randint(0, V, (b, time))
    labels[0, 4] = -100
    k = int(shift)
    ref = F.cross_entropy((x[:, :-k] @ w.T).reshape(-1, V), labels[:, k:].reshape(-1), reduction=reduction)
    ours, lse, acc = linear_cross_entropy(x, w, labels, shift=shift, reduction=reduction, return_lse=True,
                                          return_accuracy=True)
    torch.testing.assert_close(ours, ref.reshape(b, time - k) if reduction == "none" else ref, rtol=1e-5, atol=1e-6)
    assert lse.shape == (b, time - k)
    torch.testing.assert_close(lse[1], torch.logsumexp(x[1, :-k] @ w.T, -1))
    hits = ((x[:, :-k] @ w.T).argmax(-1) == labels[:, k:]) & (labels[:, k:] != -100)
    if reduction == "none":
        torch.testing.assert_close(acc, hits.float())
    with pytest.raises(ValueError, match="shift=11 needs a target whose last"):
        linear_cross_entropy(x, w, labels, shift=11)
    with pytest.raises(ValueError, match="shift"):
        linear_cross_entropy(x, w, labels, shift=-1)


# -- numerics: logits in the head's dtype (transformers) or float32 (CCE) ---------------------------------------
def _transformers_reference(x, w, t, b=None, softcap=None):
    """What an unfused bf16 head and transformers' ForCausalLMLoss compute: logits rounded to the head's dtype,
    softcap in it (Gemma's order), a float32 loss; the gradients through the head in its dtype."""
    xs, ws = _leaves(x, w)
    bs = None if b is None else b.clone().requires_grad_()
    z = F.linear(xs, ws, bs)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    loss = F.cross_entropy(z.float(), t)
    loss.backward()
    return loss, xs.grad, ws.grad, None if bs is None else bs.grad


@pytest.mark.parametrize("native", [True, False], ids=["native_bf16_gemm", "fp32_gemm_rounded"])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_head_numerics_compute_what_transformers_computes(monkeypatch, native, softcap, bias):
    """``logits_dtype="head"`` (the transformers path's default), both CPU paths, on any CPU (bf16 GEMMs without
    matrix units are emulated: slow, the same numbers)."""
    import sys

    monkeypatch.setattr(sys.modules["lightning_memkit.ops.linear_cross_entropy"], "native_half_matmul",
                        lambda dtype: native)
    x, w, t = _inputs(torch.bfloat16, n=64, v=301)
    b = torch.randn(V).bfloat16() if bias else None
    ref = _transformers_reference(x, w, t, b, softcap)
    xs, ws = _leaves(x, w)
    bs = None if b is None else b.clone().requires_grad_()
    loss = linear_cross_entropy(xs, ws, t, bias=bs, softcap=softcap, chunk_size=16, logits_dtype="head")
    loss.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref[0], rtol=2e-6, atol=2e-6)  # float32 rounding
    db = None if bs is None else bs.grad
    for ours, theirs, name in ((xs.grad, ref[1], "dx"), (ws.grad, ref[2], "dW"), (db, ref[3], "db")):
        if theirs is not None:  # one bf16 rounding of the same products (dW: of each 16-row chunk's sum)
            assert ours.dtype == torch.bfloat16
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=1.6e-2, atol=1e-3, msg=name)


def test_the_default_float32_logits_are_closer_to_the_fp64_oracle_than_the_rounded_ones():
    x, w, t = _inputs(torch.bfloat16, n=256, v=2000)
    oracle = F.cross_entropy(x.double() @ w.double().T, t)
    exact = linear_cross_entropy(x, w, t)
    rounded = linear_cross_entropy(x, w, t, logits_dtype="head")
    assert torch.equal(exact, linear_cross_entropy(x, w, t, logits_dtype="float32"))
    assert torch.equal(rounded, linear_cross_entropy(x, w, t, logits_dtype=torch.bfloat16))  # the inputs' dtype
    assert abs(exact.double() - oracle) < 1e-5 < abs(rounded.double() - oracle) < 1e-2
    for bad in (torch.float16, None, "bf16"):
        with pytest.raises(ValueError, match="logits_dtype must be torch.float32 or 'float32'.*'head'"):
            linear_cross_entropy(x, w, t, logits_dtype=bad)
    x32, w32 = x.float(), w.float()
    assert torch.equal(linear_cross_entropy(x32, w32, t), linear_cross_entropy(x32, w32, t, logits_dtype="head"))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_bf16_second_backward_recomputes_the_same_gradients(reduction):
    """A second backward (retain_graph, ``reduction="none"``) recomputes every slice and gives the same gradients."""
    x, w, t = _inputs(torch.bfloat16, n=50, v=301)
    xs, ws = _leaves(x, w)
    loss = linear_cross_entropy(xs, ws, t, reduction=reduction, chunk_size=16, logits_dtype="head")
    loss.sum().backward(retain_graph=reduction == "none")
    first = xs.grad.clone(), ws.grad.clone()
    if reduction == "none":
        xs.grad = ws.grad = None
        loss.sum().backward()
        assert torch.equal(xs.grad, first[0]) and torch.equal(ws.grad, first[1])
    ref = _transformers_reference(x, w, t) if reduction == "mean" else None
    if ref is not None:
        torch.testing.assert_close(first[0].float(), ref[1].float(), rtol=1.6e-2, atol=1e-3)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_z_loss_is_returned_as_the_term_the_loss_includes(reduction, weighted):
    """``return_z_loss``: ``z_loss * lse**2`` per kept token, reduced as the loss (unweighted, over the kept count), the
    same as a float64 reference and as the loss with the z-loss minus the loss without it."""
    x, w, t = _inputs()
    weights = torch.rand(w.shape[0]) + 0.5 if weighted else None
    loss, z = linear_cross_entropy(x, w, t, z_loss=1e-2, reduction=reduction, class_weights=weights,
                                   return_z_loss=True, chunk_size=8)
    plain = linear_cross_entropy(x, w, t, reduction=reduction, class_weights=weights, chunk_size=8)
    valid = t != -100
    rows = torch.where(valid, 1e-2 * torch.logsumexp(x.double() @ w.double().T, -1) ** 2, 0.0)
    expected = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / valid.sum()}[reduction]
    assert z.dtype == torch.float32 and not z.requires_grad
    torch.testing.assert_close(z.double(), expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss - plain, z, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="return_z_loss"):
        linear_cross_entropy(x, w, t, return_z_loss=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shift", [0, 1])
def test_predicted_tokens_are_the_argmax_per_token_and_minus_one_where_ignored(dtype, shift):
    """``return_predicted_tokens``: a float64 reference's argmax per kept token, -1 at ignored ones, the targets'
    shape less the shift, every reduction; the token accuracy is the fraction of them that hit."""
    x, w, t = _inputs(dtype, n=36)
    x, t = x.view(2, -1, x.shape[-1]), t.view(2, -1)
    t[:, :5] = (x[:, :5].double() @ w.double().T).argmax(-1)  # some hits for sure
    t[0, 7] = -100
    target = t[:, shift:]
    logits = x[:, : x.shape[1] - shift].double() @ w.double().T
    expected = torch.where(target != -100, logits.argmax(-1), -1)
    for reduction in ("mean", "sum", "none"):
        _, acc, predicted = linear_cross_entropy(x, w, t, shift=shift, reduction=reduction, return_accuracy=True,
                                                 return_predicted_tokens=True, chunk_size=8)
        assert predicted.dtype == torch.long and predicted.shape == target.shape
        kept = target != -100
        near = (logits.topk(2, -1).values.diff(dim=-1).abs().squeeze(-1) < 1e-2) & kept  # bf16 near-ties aside
        assert torch.equal(predicted[~near], expected[~near]) and (predicted[~kept] == -1).all()
        if reduction != "none":
            torch.testing.assert_close(acc, ((predicted == target) & kept).sum() / kept.sum(), check_dtype=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_softcap_bias_and_class_weights_in_half_precision_against_float64(dtype, reduction):
    """The default float32 logits: softcap 20, a bias and class weights on fp16/bf16 inputs give the float64 loss of
    the same (rounded) inputs to float32 rounding, and its gradients to one rounding to the inputs' dtype (``dW``
    accumulated in float32 across the chunks, ``accum_dtype=torch.float32``)."""
    g = torch.Generator().manual_seed(3)
    n, v, h = 40, 90, 16
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * 2).to(dtype)
    b = (torch.randn(v, generator=g) * 0.02).to(dtype)
    cw = torch.rand(v, generator=g) + 0.5
    t = torch.randint(0, v, (n,), generator=g)
    t[::6] = -100
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    z = 20.0 * torch.tanh(F.linear(x64, w64, b.double()) / 20.0)
    ref = F.cross_entropy(z, t, weight=cw.double(), reduction=reduction)
    go = torch.rand(ref.shape, generator=g, dtype=torch.float64) + 0.5
    ref.backward(go)
    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ours = linear_cross_entropy(xs, ws, t, bias=b, softcap=20.0, class_weights=cw, reduction=reduction, chunk_size=16,
                                accum_dtype=torch.float32)
    ours.backward(go.float())
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), ref.detach(), rtol=2e-6, atol=2e-6)
    step = 2.0 ** -(8 if dtype == torch.bfloat16 else 11)  # one rounding to the inputs' dtype
    for mine, truth in ((xs.grad, x64.grad), (ws.grad, w64.grad)):
        assert mine.dtype == dtype
        assert (mine.double() - truth).abs().max() <= step * truth.abs().max()
