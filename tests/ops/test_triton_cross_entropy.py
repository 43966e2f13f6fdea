"""The Triton cross-entropy kernel on CPU under ``TRITON_INTERPRET=1``.

The interpreter is chosen when triton decorates the kernel, so the checks run in a subprocess with
the variable set (it never leaks into other tests): the driver test below re-runs this file and
``test_padded_index_gather.py`` there, where only the ``interpreted`` tests run.
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
    files = [str(Path(__file__)), str(Path(__file__).with_name("test_padded_index_gather.py"))]
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
def test_interpreted_bf16_default_computes_what_transformers_computes(small_blocks, softcap):
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
    ours = linear_cross_entropy(*ours_leaves, target, softcap=softcap, chunk_size=13, backend="triton")
    ours.backward()
    torch.testing.assert_close(ours, ref, rtol=2e-6, atol=2e-6)
    for name, o, r in zip(("dx", "dW"), ours_leaves, ref_leaves):
        torch.testing.assert_close(o.grad.float(), r.grad.float(), rtol=1.6e-2, atol=1e-3, msg=name)


@interpreted
def test_interpreted_bad_target_is_nan_not_a_crash(small_blocks):
    logits = torch.randn(4, 150, requires_grad=True)
    target = torch.tensor([3, 150, -7, -100])
    loss = cross_entropy(logits, target, reduction="none", validate=False, backend="triton")
    assert torch.isnan(loss[1]) and torch.isnan(loss[2]) and loss[3] == 0 and torch.isfinite(loss[0])
    loss[0].backward()  # a bad target's gradient is NaN too; the other rows are unaffected
    assert torch.isfinite(logits.grad[0]).all() and logits.grad[3].abs().sum() == 0
    assert torch.isnan(logits.grad[1:3]).all()
