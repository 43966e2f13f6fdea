"""The Triton cross-entropy kernel on CPU under ``TRITON_INTERPRET=1``.

The interpreter is chosen when triton decorates the kernel, so the checks run in a subprocess with
the variable set (it never leaks into other tests): the driver test below re-runs this file,
``test_padded_index_gather.py`` and ``test_triton_class_weights.py`` there, where only the ``interpreted`` tests
run.
"""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cross_entropy_oracle import OPTION_SETS, assert_within, check_against_oracle, make_target, reference_loss

from lightning_memkit.ops import cross_entropy, linear_cross_entropy

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parents[2]
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")


def test_triton_kernels_in_a_subprocess():
    if INTERPRETING:
        pytest.skip("already inside the interpreter run")
    pytest.importorskip("triton")
    # a fresh interpreter (triton.language decorates its own functions at import: a process forked from one that
    # imported Lightning would hold compiled ones) that imports no library beyond what these tests do
    env = dict(os.environ, TRITON_INTERPRET="1", MEMKIT_TEST_GC_FREEZE="0")
    files = [str(Path(__file__)), *(str(Path(__file__).with_name(name)) for name in
                                    ("test_padded_index_gather.py", "test_triton_class_weights.py",
                                                                     "test_token_scaling.py"))]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interpreted", *files]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, out
    assert " passed" in run.stdout and "skipped" not in run.stdout, out


@pytest.fixture
def small_blocks(monkeypatch):
    from lightning_memkit.ops.triton import cross_entropy as kernels

    monkeypatch.setattr(kernels, "MAX_BLOCK", 64)  # V=150: three blocks, the last one ragged


CASES = [(dt, red, opts, inplace) for dt, red, opts in [
    (torch.float32, "mean", "all"), (torch.float32, "none", "all"), (torch.float32, "sum", "plain"),
    (torch.bfloat16, "mean", "all")] for inplace in (False, True)]


@interpreted
@pytest.mark.parametrize(("dtype", "reduction", "opts", "inplace"), CASES)
def test_interpreted_cross_entropy(small_blocks, dtype, reduction, opts, inplace):
    opts = OPTION_SETS[opts]
    n, v = 13, 150
    base = (torch.randn(n, v) * 3).to(dtype)
    target = make_target(n, v)
    loss_fn = functools.partial(cross_entropy, inplace_backward=inplace, backend="triton")
    ours_in = check_against_oracle(loss_fn, base, target, reduction, opts, TOL[dtype])
    assert torch.equal(ours_in.grad[target == -100], torch.zeros_like(ours_in.grad[target == -100]))


@interpreted
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_linear_cross_entropy(small_blocks, dtype, reduction):
    """float32 logits (the default for fp32 inputs; ``logits_dtype=torch.float32`` for bf16) against the oracle."""
    opts = OPTION_SETS["all"]
    n, h, v = 13, 8, 150
    x, w, b = torch.randn(n, h).to(dtype), (torch.randn(v, h) * 0.7).to(dtype), torch.randn(v).to(dtype)
    target = make_target(n, v)
    oracle_leaves = [t.double().requires_grad_() for t in (x, w, b)]
    oracle = reference_loss(torch.nn.functional.linear(*oracle_leaves), target, reduction=reduction, **opts)
    grad_out = torch.rand_like(oracle) + 0.5
    oracle.backward(grad_out)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    ref = reference_loss(torch.nn.functional.linear(*ref_leaves), target, reduction=reduction, **opts)
    ref.backward(grad_out.to(dtype))
    ours_leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    ours = linear_cross_entropy(ours_leaves[0], ours_leaves[1], target, bias=ours_leaves[2], reduction=reduction,
                                chunk_size=5, backend="triton", logits_dtype=torch.float32, **opts)
    ours.backward(grad_out.to(ours.dtype))
    assert_within(ours.detach(), ref.detach(), oracle.detach(), TOL[dtype], "loss")
    for name, o, r, q in zip(("dx", "dW", "db"), ours_leaves, ref_leaves, oracle_leaves):
        assert_within(o.grad, r.grad, q.grad, TOL[dtype], name)


@interpreted
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_interpreted_bf16_head_numerics_compute_what_transformers_computes(small_blocks, softcap):
    """bf16 logits (the default): the kernel path gives transformers' loss to float32 rounding and its gradients to
    one bf16 rounding, softcap in bf16 (Gemma's order) included."""
    n, h, v = 13, 8, 150
    x, w = torch.randn(n, h).bfloat16(), (torch.randn(v, h) * 0.7).bfloat16()
    target = make_target(n, v)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w)]
    z = torch.nn.functional.linear(*ref_leaves)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    ref = torch.nn.functional.cross_entropy(z.float(), target)
    ref.backward()
    ours_leaves = [t.clone().requires_grad_() for t in (x, w)]
    ours = linear_cross_entropy(*ours_leaves, target, softcap=softcap, chunk_size=13, backend="triton",
                                logits_dtype="head")
    ours.backward()
    torch.testing.assert_close(ours, ref, rtol=2e-6, atol=2e-6)
    for name, o, r in zip(("dx", "dW"), ours_leaves, ref_leaves):
        torch.testing.assert_close(o.grad.float(), r.grad.float(), rtol=1.6e-2, atol=1e-3, msg=name)


@interpreted
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_interpreted_peer_options_through_the_kernel(small_blocks, reduction):
    """class_weights (torch's weight=, smoothing and z-loss), shift, return_lse and return_accuracy on the kernel
    path agree with float64 references, gradients included."""
    b, time, h, v = 2, 7, 8, 150
    x, w = torch.randn(b, time, h), torch.randn(v, h) * 0.7
    labels = torch.randint(0, v, (b, time))
    labels[0, 2] = -100
    cw = torch.rand(v) + 0.5
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    z = (x64[:, :-1] @ w64.T).reshape(-1, v)
    t = labels[:, 1:].reshape(-1)
    valid = t != -100
    ce = torch.nn.functional.cross_entropy(z, t, weight=cw.double(), label_smoothing=0.1, reduction="none")
    lse_ref = torch.logsumexp(z, -1) * valid
    zl = 0.02 * lse_ref**2
    ref = ce.sum() / cw.double()[t[valid]].sum() + zl.sum() / valid.sum() if reduction == "mean" else ce + zl
    (ref.sum() + lse_ref.sum()).backward()
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, lse, acc = linear_cross_entropy(xs, ws, labels, shift=1, class_weights=cw, label_smoothing=0.1, z_loss=0.02,
                                          reduction=reduction, return_lse=True, return_accuracy=True, chunk_size=5,
                                          backend="triton")
    torch.testing.assert_close(loss.double().reshape(-1), ref.detach().reshape(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double().reshape(-1), lse_ref.detach(), rtol=1e-5, atol=1e-6)
    hits = ((z.argmax(-1) == t) & valid).double()
    expected = hits if reduction == "none" else (hits.sum() / valid.sum()).reshape(1)
    torch.testing.assert_close(acc.double().reshape(-1), expected)
    (loss.sum() + lse.sum()).backward()
    torch.testing.assert_close(xs.grad.double(), x64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ws.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)


@interpreted
def test_interpreted_bad_target_is_nan_not_a_crash(small_blocks):
    logits = torch.randn(4, 150, requires_grad=True)
    target = torch.tensor([3, 150, -7, -100])
    loss = cross_entropy(logits, target, reduction="none", validate=False, backend="triton")
    assert torch.isnan(loss[1]) and torch.isnan(loss[2]) and loss[3] == 0 and torch.isfinite(loss[0])
    loss[0].backward()  # a bad target's gradient is NaN too; the other rows are unaffected
    assert torch.isfinite(logits.grad[0]).all() and logits.grad[3].abs().sum() == 0
    assert torch.isnan(logits.grad[1:3]).all()
