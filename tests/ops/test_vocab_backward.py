"""The half path's backward over slices of the vocabulary (``ops/_vocab_backward.py``): bf16 GEMMs in the head's
dtype, ``dW`` written once per slice, ``dx`` accumulated in float32 (``logits_dtype="head"``). Forced on any CPU
(without bf16 matrix units the GEMMs are emulated: slower, the same numbers)."""

import sys

import pytest
import torch
import torch.nn.functional as F
from cross_entropy_oracle import make_target
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from lightning_memkit.estimate.trace import FlopCount
from lightning_memkit.memory import LivePeak
from lightning_memkit.ops import linear_cross_entropy
from lightning_memkit.ops._cross_entropy_common import CrossEntropyOptions
from lightning_memkit.ops.linear_cross_entropy import chunk_plan

N, H, V = 61, 32, 409


@pytest.fixture(autouse=True)
def _native_bf16(monkeypatch):
    monkeypatch.setattr(sys.modules["lightning_memkit.ops.linear_cross_entropy"], "native_half_matmul", lambda d: True)


def _inputs(n=N, h=H, v=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).bfloat16()
    w = (torch.randn(v, h, generator=g) * 2 / h**0.5).bfloat16()
    return x, w, make_target(n, v, generator=g), (torch.randn(v, generator=g) * 0.1).bfloat16()


def _leaves(*tensors):
    return [None if t is None else t.clone().requires_grad_() for t in tensors]


def _unfused(x, w, b, t, *, softcap=None, eps=0.0, z_loss=0.0, cw=None, reduction="mean"):
    """transformers' unfused head and loss: bf16 logits (softcap in bf16), a float32 loss, z-loss Liger's way."""
    z = F.linear(x, w, b)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    z = z.float()
    valid = t != -100
    ce = F.cross_entropy(z, t, weight=cw, label_smoothing=eps, reduction="none")
    zl = z_loss * torch.logsumexp(z, -1) ** 2 * valid
    if reduction == "mean":
        den = valid.sum() if cw is None else cw[t[valid]].sum()
        return ce.sum() / den + zl.sum() / valid.sum()
    return ce.sum() + zl.sum() if reduction == "sum" else ce + zl


OPTIONS = {
    "plain": {},
    "softcap_bias": {"softcap": 4.0, "bias": True},
    "smoothing_zloss_weights": {"eps": 0.1, "z_loss": 1e-3, "cw": True},
    "everything": {"softcap": 4.0, "bias": True, "eps": 0.2, "z_loss": 1e-3, "cw": True},
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_many_slices_give_the_unfused_heads_loss_and_gradients(name, reduction):
    """Slices of 409 * 5 // 61 = 33 classes (13 slices, targets in every one): the loss to float32 rounding, dW and
    db bitwise those of one slice (the same dot products), all gradients within one bf16 rounding of the unfused
    head's."""
    opts = dict(OPTIONS[name])
    x, w, t, b = _inputs()
    b = b if opts.pop("bias", False) else None
    cw = torch.rand(V, generator=torch.Generator().manual_seed(3)) + 0.5 if opts.pop("cw", False) else None
    kw = {"softcap": opts.get("softcap"), "label_smoothing": opts.get("eps", 0.0), "z_loss": opts.get("z_loss", 0.0),
          "class_weights": cw, "reduction": reduction}
    rx, rw, rb = _leaves(x, w, b)
    ref = _unfused(rx, rw, rb, t, cw=cw, reduction=reduction, **opts)
    grad_out = torch.rand_like(ref) + 0.5
    ref.backward(grad_out)
    runs = []
    for chunk in (5, N):  # 13 slices, then one slice holding the vocabulary
        lx, lw, lb = _leaves(x, w, b)
        loss = linear_cross_entropy(lx, lw, t, bias=lb, chunk_size=chunk, **kw, logits_dtype="head")
        loss.backward(grad_out)
        runs.append((loss.detach(), lx.grad, lw.grad, None if lb is None else lb.grad))
    for loss, dx, dw, db in runs:
        assert loss.dtype == torch.float32 and dx.dtype == dw.dtype == torch.bfloat16
        torch.testing.assert_close(loss, ref.detach(), rtol=3e-6, atol=3e-6)
        for ours, theirs, what in ((dx, rx.grad, "dx"), (dw, rw.grad, "dW"), (db, None if rb is None else rb.grad,
                                                                                "db")):
            if theirs is not None:
                scale = float(theirs.float().abs().max())
                torch.testing.assert_close(ours.float(), theirs.float(), rtol=8e-3, atol=8e-3 * scale, msg=what)
    assert torch.equal(runs[0][2], runs[1][2])
    if b is not None:
        assert torch.equal(runs[0][3], runs[1][3])


def test_ignored_rows_get_no_gradient_and_a_bad_target_poisons_only_its_row():
    x, w, t, _ = _inputs()
    t[3], t[10] = -100, V + 5  # ignored; out of range (not validated)
    lx, lw = _leaves(x, w)
    loss = linear_cross_entropy(lx, lw, t, reduction="none", validate=False, chunk_size=5, logits_dtype="head")
    loss.sum().backward()
    assert torch.all(lx.grad[3] == 0) and loss[3] == 0
    assert torch.isnan(loss[10]) and torch.isnan(lx.grad[10]).all()
    others = torch.ones(N, dtype=torch.bool)
    others[10] = False
    # (a GEMM kernel may spread a NaN to the neighbouring row it packs with; rows far from it stay finite)
    assert torch.isfinite(loss[others]).all() and torch.isfinite(lx.grad[20:]).all() and torch.isnan(lw.grad).any()


def test_the_plan_slices_the_vocabulary_only_on_the_half_path_within_the_chunk_budget():
    x, w, _, _ = _inputs(n=512, h=64, v=32000)
    o = CrossEntropyOptions()
    half = chunk_plan(x, w, 512, o, "torch", "auto", 4 * 2**20, round_to=torch.bfloat16)
    rows_fp32 = chunk_plan(x, w, 512, o, "torch", "auto", 4 * 2**20, round_to=None)  # float32 logits
    assert half.sub > 0 and 0 < half.cols < 32000 and rows_fp32.cols == 0
    # the slice buffer plus the float32 dx accumulator beyond dx fit in the budget left beside the fp32 block
    assert 512 * half.cols * 2 + 4 * 512 * 64 <= 4 * 2**20 - half.sub * 32000 * 4
    assert chunk_plan(x, w, 512, o, "torch", 64, None, round_to=torch.bfloat16).cols == 64 * 32000 // 512


def _step(fake: bool, counter, reduction="mean", softcap=None) -> int:
    """LivePeak bytes of a bf16 half-path forward and backward in several chunks and slices."""
    n, h, v = 96, 32, 1000
    with FakeTensorMode() if fake else torch.device("cpu"), LivePeak() as lp, counter:
        x = torch.zeros(n, h, dtype=torch.bfloat16, requires_grad=True)
        w = torch.zeros(v, h, dtype=torch.bfloat16, requires_grad=True)
        loss = linear_cross_entropy(x, w, torch.zeros(n, dtype=torch.long), reduction=reduction, chunk_bytes=432_000,
                                    logits_dtype="head", softcap=softcap)
        loss.sum().backward()
    return lp.peak_bytes


@pytest.mark.parametrize(("reduction", "softcap"), [("mean", None), ("none", 5.0)])
def test_on_fake_tensors_the_slices_have_the_bytes_and_flops_of_the_real_ones(reduction, softcap):
    """An estimate traces one float32 block per slice, and one slice of full width for all of them (its FLOPs
    counted as often, as the estimate's counters do): the same storages (LivePeak's peak), the same FLOPs."""
    real_flops, fake_flops = FlopCount(), FlopCount()
    real = _step(False, real_flops, reduction, softcap)
    fake = _step(True, fake_flops, reduction, softcap)
    assert fake == real
    assert fake_flops.total == real_flops.total == 4 * 2 * 96 * 32 * 1000
    torch_count = FlopCounterMode(display=False)  # torch's own counter sees the one slice standing for the others
    _step(True, torch_count, reduction, softcap)
    assert torch_count.get_total_flops() < real_flops.total


def test_backward_holds_one_slice_one_block_and_the_dx_accumulator_beyond_the_gradients():
    n, h, v = 256, 64, 4000
    x, w, t, _ = _inputs(n, h, v)
    lx, lw = _leaves(x, w)
    budget = 300_000
    plan = chunk_plan(lx, lw, n, CrossEntropyOptions(), "torch", "auto", budget, round_to=torch.bfloat16)
    loss = linear_cross_entropy(lx, lw, t, chunk_bytes=budget, logits_dtype="head")
    with LivePeak() as lp:
        loss.backward()
    grads = lw.numel() * 2 + lx.numel() * 2
    block = min(n, max(16, 2 * 2**20 // (4 * plan.cols)))
    extra = n * plan.cols * 2 + block * plan.cols * 4 + 4 * n * h
    assert v / plan.cols > 5
    assert n * plan.cols * 2 + grads <= lp.peak_bytes <= grads + extra + 64 * n
