"""cross_entropy(inplace_backward=True) refuses logits whose rows share memory; the default path handles them."""

import pytest
import torch
import torch.nn.functional as F

from lightning_memkit.ops import cross_entropy

N, V = 6, 11
TARGET = torch.tensor([1, 2, -100, 4, 10, 0])
OPTS = {"label_smoothing": 0.1}


def _expand(base):
    return base.expand(N, V)


def _as_strided(base):
    return base.as_strided((N, V), (3, 1))  # row i starts 3 elements after row i - 1: rows overlap


CASES = {"expand": (lambda: torch.randn(1, V), _expand), "as_strided": (lambda: torch.randn(N * 3 + V), _as_strided)}


def _reference(base, view):
    """fp64 loss and gradient w.r.t. ``base`` of F.cross_entropy on the same view."""
    b = base.detach().double().requires_grad_()
    loss = F.cross_entropy(view(b), TARGET, **OPTS)
    loss.backward()
    return loss.detach(), b.grad


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_inplace_backward_on_overlapping_logits_is_refused(case, backend):
    make, view = CASES[case]
    base = make().requires_grad_()
    before = base.detach().clone()
    with pytest.raises(ValueError, match=r"cross_entropy\(inplace_backward=True\): logits of shape \(6, 11\) and "
                                         r"strides .* overlap themselves .*pass inplace_backward=False"):
        cross_entropy(view(base), TARGET, inplace_backward=True, backend=backend, **OPTS)
    assert torch.equal(base.detach(), before) and base.grad is None


@pytest.mark.parametrize("case", list(CASES))
def test_out_of_place_path_on_overlapping_logits_matches_fp64(case):
    make, view = CASES[case]
    base = make().requires_grad_()
    want_loss, want_grad = _reference(base, view)
    loss = cross_entropy(view(base), TARGET, **OPTS)
    loss.backward()
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(base.grad.double(), want_grad, rtol=1e-5, atol=1e-6)


def test_strided_but_not_overlapping_logits_still_run_in_place():
    """A column slice is not dense (``_debug_has_internal_overlap`` says "too hard"), yet its rows are disjoint."""
    wide = torch.randn(N, V + 3, dtype=torch.float64, requires_grad=True)
    want_loss, want_grad = _reference(wide, lambda t: t[:, :V])
    loss = cross_entropy(wide[:, :V], TARGET, inplace_backward=True, **OPTS)
    loss.backward()
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(wide.grad, want_grad)
