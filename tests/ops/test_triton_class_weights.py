"""Class weights and the z-loss scale of the Triton cross-entropy kernel (``ce_rows``), on CPU under
``TRITON_INTERPRET=1``.

As in ``test_triton_cross_entropy.py``, the interpreter is chosen when triton decorates the kernel, so the kernel
checks run in a subprocess with the variable set: the driver test of ``test_triton_cross_entropy.py`` re-runs
this file there, where only the ``interpreted`` tests run. The reference is PyTorch's
``F.cross_entropy(weight=..., label_smoothing=...)`` in float64 on the (soft-capped) logits plus ``zl * lse**2``,
differentiated by autograd with respect to the raw logits.
"""

import os

import pytest
import torch
import torch.nn.functional as F

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")

N, V = 13, 150
IGNORED = [2, 7]
OPTION_SETS = {
    "plain": {"label_smoothing": 0.0, "z_loss": 0.0, "softcap": None},
    "smoothing": {"label_smoothing": 0.3, "z_loss": 0.0, "softcap": None},
    "zloss_softcap": {"label_smoothing": 0.0, "z_loss": 0.05, "softcap": 4.0},
    "all": {"label_smoothing": 0.2, "z_loss": 0.02, "softcap": 3.0},
}
# one conversion of the fp32 gradient to bfloat16, relative: half a unit in the last place on a GPU (round to
# nearest even), a whole one under the interpreter (its fp32 -> bf16 cast truncates)
BF16_ROUNDING = 2.0**-7


@pytest.fixture
def kernels(monkeypatch):
    from lightning_memkit.ops.triton import cross_entropy as kernels

    monkeypatch.setattr(kernels, "MAX_BLOCK", 64)  # V=150: three blocks, the last one ragged
    return kernels


def make_case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, V, generator=g) * 3).to(dtype)
    target = torch.randint(0, V, (N,), generator=g)
    target[IGNORED] = -100
    target[0], target[1], target[3] = 5, V - 1, 0  # a zero-weight class, the ragged block's last class, the first
    weight = torch.rand(V, generator=g) * 2 + 0.1
    weight[5] = 0.0
    return x, target, weight


def reference(x, target, weight, *, label_smoothing, zl, softcap, scale):
    """Per-row loss, lse and ``d(sum(loss * scale))/dx`` in float64."""
    x64 = x.double().requires_grad_()
    z = x64 if softcap is None else softcap * torch.tanh(x64 / softcap)
    loss = F.cross_entropy(z, target, weight=weight.double(), label_smoothing=label_smoothing, ignore_index=-100,
                           reduction="none")
    lse = torch.logsumexp(z, -1)
    loss = loss + zl * lse**2 * (target != -100)
    (loss * scale.double()).sum().backward()
    return loss.detach(), lse.detach(), x64.grad


def assert_near(ours, ref, rtol, what, elementwise_rtol=0.0):
    """``|ours - ref| <= elementwise_rtol * |ref| + rtol * max|ref|``."""
    err = (ours.double() - ref).abs()
    bound = elementwise_rtol * ref.abs() + rtol * ref.abs().max()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), f"{what}: error {err.flatten()[worst]:.3e} > {bound.flatten()[worst]:.3e}"


def test_torch_weighted_smoothing_is_the_formula_the_kernel_computes():
    """The reference's premise: per row, torch's weighted, smoothed cross-entropy (``reduction="none"``) is
    ``(1-eps) w_t (lse - z_t) + eps/V (W lse - sum_c w_c z_c)``, unnormalised by the weights."""
    x, target, weight = make_case(torch.float32)
    z, w, eps = x.double(), weight.double(), 0.3
    torch_loss = F.cross_entropy(z, target, weight=w, label_smoothing=eps, ignore_index=-100, reduction="none")
    lse = torch.logsumexp(z, -1)
    valid = target != -100
    t = target.clamp(min=0)
    formula = (1 - eps) * w[t] * (lse - z.gather(1, t[:, None])[:, 0]) + eps / V * (w.sum() * lse - z @ w)
    torch.testing.assert_close(torch_loss, formula * valid, rtol=1e-12, atol=1e-12)
    assert torch_loss[0] != 0 and torch_loss[IGNORED].eq(0).all()


CASES = [
    (torch.float32, "plain", "rows", False),
    (torch.float32, "smoothing", "one", False),
    (torch.float32, "zloss_softcap", "rows", True),
    (torch.float32, "all", "rows", True),
    (torch.float32, "all", "one", False),
    (torch.bfloat16, "all", "rows", True),
    (torch.bfloat16, "smoothing", "one", False),
]


@interpreted
@pytest.mark.parametrize(("dtype", "opts", "scale_kind", "with_z_scale"), CASES,
                         ids=[f"{str(c[0])[6:]}-{c[1]}-{c[2]}{'-zscale' if c[3] else ''}" for c in CASES])
def test_interpreted_weighted_against_torch(kernels, dtype, opts, scale_kind, with_z_scale):
    opts = OPTION_SETS[opts]
    x, target, weight = make_case(dtype)
    g = torch.Generator().manual_seed(1)
    scale = torch.rand(N if scale_kind == "rows" else 1, generator=g) + 0.5
    extra = {"weight": weight, "weight_sum": weight.sum().reshape(1)}
    zl = opts["z_loss"]
    z_loss_arg = zl
    if with_z_scale:  # z_loss * z_scale is the coefficient: the same zl, reached through the tensor
        extra["z_scale"] = torch.tensor([0.25])
        z_loss_arg = zl * 4
    common = {"ignore_index": -100, "label_smoothing": opts["label_smoothing"], "z_loss": z_loss_arg,
              "softcap": opts["softcap"], "grad_scale": scale, **extra}

    loss = torch.full((N,), float("nan"))
    grad = torch.full_like(x, float("nan"))
    lse = kernels.ce_rows(x, target, loss=loss, grad=grad, **common)
    ref_loss, ref_lse, ref_grad = reference(x, target, weight, label_smoothing=opts["label_smoothing"], zl=zl,
                                            softcap=opts["softcap"], scale=scale)
    valid = target != -100
    assert_near(loss, ref_loss, 1e-5, "loss")
    assert_near(lse[valid], ref_lse[valid], 1e-5, "lse")
    bf16 = dtype == torch.bfloat16
    assert_near(grad, ref_grad, 1e-5, "grad", elementwise_rtol=BF16_ROUNDING if bf16 else 0.0)
    assert torch.equal(loss[IGNORED], torch.zeros(len(IGNORED)))
    assert torch.equal(grad[IGNORED], torch.zeros_like(grad[IGNORED]))
    if opts["label_smoothing"] == 0.0:  # the zero-weight target: loss only from the z-loss
        torch.testing.assert_close(loss[0].double(), zl * ref_lse[0] ** 2, rtol=1e-5, atol=1e-6)

    # the backward recompute: lse read, no loss computed, the gradient written over the logits themselves
    x2, loss2 = x.clone(), torch.full((N,), 7.0)
    kernels.ce_rows(x2, target, loss=loss2, lse=lse.clone(), lse_known=True, grad=x2, **common)
    assert torch.equal(x2, grad)
    assert loss2[valid].eq(7.0).all()  # (an ignored row's loss is set to 0 on every path)


@interpreted
@pytest.mark.parametrize("opts", ["plain", "all"])
def test_interpreted_without_weights_nothing_changes(kernels, opts):
    opts = OPTION_SETS[opts]
    x, target, _ = make_case(torch.float32, seed=2)
    scale = torch.rand(N) + 0.5
    z_loss = opts["z_loss"] or 0.02

    def run(z_loss=z_loss, **extra):
        loss, grad = torch.empty(N), torch.empty_like(x)
        lse = kernels.ce_rows(x, target, ignore_index=-100, label_smoothing=opts["label_smoothing"], z_loss=z_loss,
                              softcap=opts["softcap"], loss=loss, grad=grad, grad_scale=scale, **extra)
        return loss, lse, grad

    base = run()
    for same in (run(weight=None, weight_sum=None, z_scale=None), run(z_scale=torch.ones(1)),
                 run(z_loss=z_loss * 4, z_scale=torch.tensor([0.25]))):  # z_loss * 2**k is exact
        assert all(torch.equal(a, b) for a, b in zip(base, same))
    ones = run(weight=torch.ones(V), weight_sum=torch.tensor([float(V)]))  # the weighted path, unit weights
    for a, b, what in zip(base, ones, ("loss", "lse", "grad")):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item(), msg=what)


@interpreted
def test_interpreted_weighted_bad_target_is_nan(kernels):
    x = torch.randn(4, V)
    target = torch.tensor([3, V, -7, -100])
    weight = torch.rand(V) + 0.5
    loss, grad = torch.empty(4), torch.empty_like(x)
    kernels.ce_rows(x, target, ignore_index=-100, label_smoothing=0.1, z_loss=0.01, softcap=None, loss=loss,
                    grad=grad, grad_scale=torch.ones(1), weight=weight, weight_sum=weight.sum().reshape(1))
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1:3]).all() and loss[3] == 0
    assert torch.isfinite(grad[0]).all() and torch.isnan(grad[1:3]).all() and grad[3].abs().sum() == 0


@interpreted
def test_interpreted_weight_needs_weight_sum(kernels):
    x, target, weight = make_case(torch.float32)
    with pytest.raises(ValueError, match="weight_sum"):
        kernels.ce_rows(x, target, ignore_index=-100, label_smoothing=0.1, z_loss=0.0, softcap=None,
                        loss=torch.empty(N), weight=weight)
    with pytest.raises(ValueError, match="weight"):
        kernels.ce_rows(x, target, ignore_index=-100, label_smoothing=0.1, z_loss=0.0, softcap=None,
                        loss=torch.empty(N), weight=weight[:-1], weight_sum=weight.sum().reshape(1))


@interpreted
def test_interpreted_bad_arguments_fail_on_empty_rows_too(kernels):
    """Argument checks come before the early return of an empty chunk: the same call fails with or without rows."""
    x, target, weight = make_case(torch.float32)
    args = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None)
    for rows in (N, 0):
        xs, ts = x[:rows], target[:rows]
        with pytest.raises(ValueError, match="weight_sum"):
            kernels.ce_rows(xs, ts, **args, weight=weight)
        with pytest.raises(ValueError, match="grad_scale"):
            kernels.ce_rows(xs, ts, **args, grad=xs.clone())
        with pytest.raises(ValueError, match="z_scale"):
            kernels.ce_rows(xs, ts, **args, z_scale=torch.ones(2))
