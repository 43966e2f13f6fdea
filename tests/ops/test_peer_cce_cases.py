"""Cut Cross-Entropy's own test cases and tolerances, on CPU: ``linear_cross_entropy`` with its default float32
logits against a float32 ground truth, allowed the error of the plain half-precision computation plus CCE's
tolerance per dtype (its forward and backward suites' criterion: shapes, softcap 20, a bias of 0.02 scale, shifts,
20% ignored targets, every reduction). The cases are rebuilt here from the suite's description; CCE is not
imported. The fast suite runs the softcap + bias cases (where the head's-dtype numerics missed the tolerance), the
slow suite every case."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from lightning_memkit.ops import linear_cross_entropy

IGNORE = -100
SHAPES = [(256, 512, 128), (252, 507, 128), (252, 507, 123)]  # (tokens, vocabulary, hidden)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _inputs(shape, dtype, has_bias: bool, invalids: bool, seed: int = 0):
    n, v, d = shape
    g = torch.Generator().manual_seed(seed)
    e = (torch.randn(n, d, generator=g) / d**0.5).to(dtype)
    c = torch.randn(v, d, generator=g).to(dtype)
    c[: min(n, v) // 2] = e[: min(n, v) // 2]  # rows aligned with the targets' embeddings: confident tokens
    bias = (torch.randn(v, generator=g) * 0.02).to(dtype) if has_bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    if invalids:
        targets[torch.randperm(n, generator=g)[: int(0.2 * n)]] = IGNORE
    return e.view(4, -1, d), c, bias, targets.view(4, -1)


def _plain(e, c, bias, targets, softcap, shift, reduction):
    """The unfused loss, every op in the inputs' dtype until the float32 cross-entropy (the peers' reference)."""
    if shift:
        e, targets = e[:, :-shift], targets[:, shift:]
    logits = e.flatten(0, -2) @ c.T
    if bias is not None:
        logits = logits + bias
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits.float(), targets.flatten(), ignore_index=IGNORE, reduction=reduction)
    return loss.view(targets.shape) if reduction == "none" else loss


def _forward_cases():
    grid = itertools.product(TOLERANCE, [None, 20.0], [True, False], [0, 2], [False, True], SHAPES)
    for dtype, softcap, has_bias, shift, invalids, shape in grid:
        fast = softcap is not None and has_bias and dtype != torch.float32 and shape == SHAPES[1]
        yield pytest.param(dtype, softcap, has_bias, shift, invalids, shape, marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("dtype,softcap,has_bias,shift,invalids,shape", list(_forward_cases()))
def test_forward_within_the_plain_errors_plus_cce_tolerance(dtype, softcap, has_bias, shift, invalids, shape):
    e, c, bias, targets = _inputs(shape, dtype, has_bias, invalids)
    truth = _plain(e.float(), c.float(), None if bias is None else bias.float(), targets, softcap, shift, "none")
    plain = _plain(e, c, bias, targets, softcap, shift, "none")
    ours = linear_cross_entropy(e, c, targets, bias=bias, softcap=softcap, shift=shift, reduction="none")
    assert ours.shape == truth.shape
    excess = (ours - truth).abs() - (plain - truth).abs()
    assert (excess <= TOLERANCE[dtype]).all(), float(excess.max())


def _grads(e, c, bias, targets, softcap, shift, reduction, fused: bool, fp32: bool = False):
    leaves = [t.detach().clone().requires_grad_(True) for t in (e, c, *([] if bias is None else [bias]))]
    e, c, *rest = [t.float() for t in leaves] if fp32 else leaves
    bias = rest[0] if rest else None
    if fused:
        loss = linear_cross_entropy(e, c, targets, bias=bias, softcap=softcap, shift=shift, reduction=reduction)
    else:
        loss = _plain(e, c, bias, targets, softcap, shift, reduction)
    if reduction == "sum":
        loss = loss / (targets[:, shift:] != IGNORE).count_nonzero()
    loss.mean().backward()
    return [t.grad for t in leaves]


def _backward_cases():
    grid = itertools.product([torch.float16, torch.bfloat16], [None, 20.0], [False, True], [0, 1], [False, True],
                             ["none", "mean", "sum"], SHAPES)
    for dtype, softcap, has_bias, shift, invalids, reduction, shape in grid:
        fast = softcap is not None and has_bias and invalids and reduction == "mean" and shape == SHAPES[1]
        yield pytest.param(dtype, softcap, has_bias, shift, invalids, reduction, shape,
                           marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("dtype,softcap,has_bias,shift,invalids,reduction,shape", list(_backward_cases()))
def test_backward_within_the_plain_errors_plus_cce_tolerance(dtype, softcap, has_bias, shift, invalids, reduction,
                                                             shape):
    e, c, bias, targets = _inputs(shape, dtype, has_bias, invalids)
    truth = _grads(e, c, bias, targets, softcap, shift, reduction, fused=False, fp32=True)
    plain = _grads(e, c, bias, targets, softcap, shift, reduction, fused=False)
    ours = _grads(e, c, bias, targets, softcap, shift, reduction, fused=True)
    for name, t, p, o in zip(("hidden", "weight", "bias"), truth, plain, ours):
        excess = (o.float() - t.float()).abs() - (p.float() - t.float()).abs()
        assert (excess <= TOLERANCE[dtype]).all(), (name, float(excess.max()))
