"""Token scaling (Liger-Kernel's ``use_token_scaling``) against a float64 oracle: each token's loss, z-loss and
smoothing included, and its gradient scaled by the detached softmax probability of its target, on the PyTorch path
(fp32 slabs, and the half path's GEMMs in the head's dtype) and, in the ``TRITON_INTERPRET=1`` subprocess of
``test_triton_cross_entropy.py``, on the Triton kernel."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from lightning_memkit.ops import linear_cross_entropy

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
Z, EPS, IGNORE = 1e-3, 0.1, -100


def _oracle(x, w, b, t, cw, reduction, softcap, head: bool):
    """The scaled loss and its gradients in float64 (Liger's definition, class weights and z-loss as Liger reduces
    them: the weighted loss over the kept targets' summed weight, the z-loss over their count); ``head``: the logits
    and softcap in the inputs' dtype, as transformers forms them, float64 from there on."""
    if not head:
        x, w, b = x.double(), w.double(), b.double()
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    z = F.linear(x, w, b)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z.double()
    kept = t != IGNORE
    cw64 = None if cw is None else cw.double()
    ce = F.cross_entropy(z, t, weight=cw64, reduction="none", label_smoothing=EPS, ignore_index=IGNORE)
    zl = torch.where(kept, Z * torch.logsumexp(z, -1) ** 2, 0.0)
    p = torch.where(kept, torch.softmax(z.detach(), -1).gather(1, t.clamp_min(0)[:, None])[:, 0], 0.0)
    if reduction == "none":
        loss, zterm = (ce + zl) * p, zl * p
    else:
        den = kept.sum() if cw is None else cw64[t.clamp_min(0)][kept].sum()
        loss = (ce * p).sum() / (den if reduction == "mean" else 1) + (zl * p).sum() / (
            kept.sum() if reduction == "mean" else 1)
        zterm = (zl * p).sum() / (kept.sum() if reduction == "mean" else 1)
    return loss, zterm, x, w


def _check(dtype, logits_dtype, reduction, softcap, weighted, backend):
    g = torch.Generator().manual_seed(7)
    n, v, h = 29, 70, 16
    x = torch.randn(n, h, generator=g).to(dtype)
    w = torch.randn(v, h, generator=g).to(dtype)
    b = torch.randn(v, generator=g).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = IGNORE
    cw = torch.rand(v, generator=g) + 0.5 if weighted else None
    ref, ref_z, x64, w64 = _oracle(x, w, b, t, cw, reduction, softcap, logits_dtype == "head")
    go = torch.rand(ref.shape, generator=g, dtype=torch.float64) + 0.5
    ref.backward(go)
    xo, wo = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss, zterm = linear_cross_entropy(
        xo, wo, t, bias=b, reduction=reduction, softcap=softcap, label_smoothing=EPS, z_loss=Z, class_weights=cw,
        token_scaling=True, return_z_loss=True, chunk_size=8, logits_dtype=logits_dtype, backend=backend)
    loss.backward(go.to(loss.dtype))
    tol = 2e-5 if dtype == torch.float32 else 3e-2  # half: the head's dtype rounds the logits or their gradient
    for ours, truth in ((loss, ref), (zterm, ref_z), (xo.grad, x64.grad), (wo.grad, w64.grad)):
        ours, truth = ours.detach().double(), truth.detach().double()
        err = (ours - truth).abs().max() / truth.abs().max().clamp_min(1e-12)
        assert err <= tol, (ours, truth, float(err))


CASES = [(dt, ld, red, cap, cw) for dt, ld in [(torch.float32, "float32"), (torch.bfloat16, "float32"),
                                              (torch.bfloat16, "head")]
         for red in ("mean", "sum", "none") for cap, cw in [(None, False), (30.0, True)]]


@pytest.mark.parametrize(("dtype", "logits_dtype", "reduction", "softcap", "weighted"), CASES)
def test_token_scaling_against_a_float64_oracle(dtype, logits_dtype, reduction, softcap, weighted):
    _check(dtype, logits_dtype, reduction, softcap, weighted, "torch")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_token_scaling_on_the_half_path(monkeypatch, reduction):
    """GEMMs in the head's dtype (a CPU with bf16 matrix units): the forward's blocked rows and the backward's
    vocabulary slices take the same factors."""
    monkeypatch.setattr(sys.modules["lightning_memkit.ops.linear_cross_entropy"], "native_half_matmul", lambda d: True)
    _check(torch.bfloat16, "head", reduction, 30.0, True, "torch")


def test_token_scaling_changes_the_loss_by_the_target_probabilities():
    """Without scaling the same call gives the plain loss; with it every kept token's loss shrinks by p_t < 1."""
    g = torch.Generator().manual_seed(1)
    x, w, t = torch.randn(12, 8, generator=g), torch.randn(40, 8, generator=g), torch.randint(0, 40, (12,), generator=g)
    plain = linear_cross_entropy(x, w, t, reduction="none")
    scaled = linear_cross_entropy(x, w, t, reduction="none", token_scaling=True)
    p = torch.softmax(x @ w.T, -1).gather(1, t[:, None])[:, 0]
    torch.testing.assert_close(scaled, plain * p, atol=1e-6, rtol=1e-5)
    assert (scaled < plain).all()


def test_token_scaling_must_be_a_bool():
    x, w, t = torch.randn(2, 4), torch.randn(5, 4), torch.tensor([0, 1])
    with pytest.raises(TypeError, match="token_scaling"):
        linear_cross_entropy(x, w, t, token_scaling="yes")


@interpreted
@pytest.mark.parametrize(("dtype", "logits_dtype", "reduction", "softcap", "weighted"),
                         [c for c in CASES if c[2] != "sum"])
def test_interpreted_token_scaling_against_a_float64_oracle(dtype, logits_dtype, reduction, softcap, weighted):
    _check(dtype, logits_dtype, reduction, softcap, weighted, "triton")
