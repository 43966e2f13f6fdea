"""Backward of :func:`~lightning_memkit.ops.linear_cross_entropy`'s half path, slice by slice of the vocabulary.

On the half path (bf16/fp16 GEMMs in the head's dtype, logits rounded to it) forward keeps only each token's
log-sum-exp. Backward then walks the vocabulary in slices of ``cols`` classes; for each slice it

* recomputes the logits of every token for those classes in one GEMM in the head's dtype (softcap in that dtype),
* turns them into the scaled float32 gradient in blocks of rows that stay in cache (the log-sum-exp is known, so
  the math is elementwise), rounded once back into the head's dtype,
* writes those classes' rows of ``dW`` (and ``db``) once: one GEMM over all tokens, as unfused autograd forms
  ``dW`` (no accumulation across chunks, no pass over the whole ``dW`` per chunk),
* adds the slice's share of ``dx`` into a float32 accumulator (``dx`` itself is one GEMM when one slice holds the
  vocabulary).

Example::

    >>> import torch
    >>> from lightning_memkit.ops import linear_cross_entropy
    >>> x = torch.randn(6, 16, dtype=torch.bfloat16, requires_grad=True)
    >>> w = torch.randn(40, 16, dtype=torch.bfloat16, requires_grad=True)
    >>> t = torch.randint(0, 40, (6,))
    >>> linear_cross_entropy(x, w, t, chunk_size=2).backward()
    >>> w.grad.dtype, x.grad.shape
    (torch.bfloat16, torch.Size([6, 16]))
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from lightning_memkit.measure.fake_repeat import alike_runs, stands_for
from lightning_memkit.ops._cross_entropy_common import RowGrad, apply_row_grad, row_grad, row_terms
from lightning_memkit.ops._head_numerics import head_softcap, head_softcap_backward

__all__ = ["block_rows", "vocab_sliced_grads"]


def block_rows(n_rows: int, cols: int, block_bytes: int, min_rows: int) -> int:
    """Rows of the float32 block of a slice of ``cols`` classes: ``block_bytes`` of them, at least ``min_rows``."""
    return max(1, min(n_rows, max(min_rows, block_bytes // (4 * max(cols, 1)))))


def vocab_sliced_grads(x, weight, bias, target, lse, scale, setup, weights, need, *, block: int):
    """``(dx, dW, db)`` of the loss rows scaled by ``scale`` (``(1,)`` or one per token), ``cols`` classes at a time.

    ``x``: ``(N, H)`` in the head's dtype, ``lse``: the rows' float32 log-sum-exp from forward, ``need``: which of
    the three gradients to form, ``block``: rows per float32 block.
    """
    n, h = x.shape
    v, cols, o = weight.shape[0], setup.plan.cols, setup.o
    ok, bad, safe, zl, w_t = row_terms(target, o, weights, v)
    coefs = row_grad(lse, scale, ok, bad, float(o.label_smoothing), zl, w_t, weights, v)
    one = cols >= v
    half = torch.empty(n * min(cols, v), dtype=x.dtype, device=x.device)
    keep = torch.empty_like(half) if o.softcap is not None else None
    f32 = torch.empty(block * min(cols, v), dtype=torch.float32, device=x.device)
    acc = torch.zeros(n, h, dtype=torch.float32, device=x.device) if need[0] and not one else None
    part = torch.empty(n, h, dtype=x.dtype, device=x.device) if acc is not None else None
    dx = torch.empty_like(x) if need[0] and one else None
    dw = torch.empty_like(weight) if need[1] else None
    db = torch.empty(v, dtype=torch.float32, device=x.device) if need[2] else None
    # fake tensors (an estimate): the slices of full width are alike, one stands for them all (its counts taken as
    # often); the values would differ, the storages do not
    for s, count in alike_runs(v, cols, is_fake(x)):
        e = min(s + cols, v)
        z = half[: n * (e - s)].view(n, e - s)
        kz = None if keep is None else keep[: n * (e - s)].view(n, e - s)
        with stands_for(count):
            _slice_logits(x, weight, bias, s, e, z, o.softcap, kz)
            _slice_gradient(z, f32, lse, coefs, ok, safe, s, e, block,
                            None if weights is None else weights.weight[s:e])
            if kz is not None:
                head_softcap_backward(z, o.softcap, kz)
            if dw is not None:
                torch.mm(z.t(), x, out=dw[s:e])
            if db is not None:
                torch.sum(z, 0, dtype=torch.float32, out=db[s:e])
            if dx is not None:
                torch.mm(z, weight, out=dx)
            elif acc is not None:
                acc.add_(torch.mm(z, weight[s:e], out=part))
    del half, keep, f32, part
    if acc is not None:
        dx = acc.to(x.dtype)
    return dx, dw, db


def _slice_logits(x, weight, bias, s: int, e: int, z, cap, keep) -> None:
    """Fill ``z`` with the logits of classes ``s:e`` for every row, rounded (and soft-capped) in the head's dtype."""
    if bias is not None:
        torch.addmm(bias[s:e], x, weight[s:e].t(), out=z)
    else:
        torch.mm(x, weight[s:e].t(), out=z)
    if cap is not None:
        head_softcap(z, cap, keep)


def _slice_gradient(z, f32, lse, coefs: RowGrad, ok, safe, s: int, e: int, block: int, class_weight) -> None:
    """Overwrite the slice's logits ``z`` with their scaled gradient, formed in float32 ``block`` rows at a time and
    rounded once to ``z``'s dtype."""
    n, k = z.shape
    inside = ok & (safe >= s) & (safe < e)
    index = torch.where(inside, safe - s, 0)
    c = coefs._replace(target=torch.where(inside, coefs.target, 0.0))
    # fake tensors (an estimate) hold no values: one block stands for the loop (the same storages, no GEMMs)
    for a in range(0, min(n, block) if is_fake(z) else n, block):
        b = min(a + block, n)
        f = f32[: (b - a) * k].view(b - a, k)
        torch.sub(z[a:b], lse[a:b].unsqueeze(1), out=f)
        f.exp_()  # p
        rows = RowGrad(*(None if t is None else t[a:b] for t in c))
        apply_row_grad(f, rows, index[a:b], class_weight)
        z[a:b].copy_(f)
