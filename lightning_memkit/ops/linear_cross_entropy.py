"""LM head plus cross-entropy without the ``(N, V)`` logits: chunked over tokens, gradients in forward.

``linear_cross_entropy(hidden, weight, target)`` equals
``F.cross_entropy(hidden @ weight.T + bias, target)`` (plus the z-loss and soft-capping options of
:func:`~lightning_memkit.ops.cross_entropy`) but holds at most one chunk of logits at a time.

Design (measured in ``benchmarks/bench_cross_entropy.py``):

* ``reduction="mean"``/``"sum"``: the gradients for ``hidden``, ``weight`` and ``bias`` are built
  chunk by chunk during forward (Liger style) into their final buffers, ``weight``/``bias``
  accumulating in ``accum_dtype`` (the weight's dtype by default; each chunk's product is formed in
  fp32 and rounded once into it). Backward only scales them *in place* by the upstream
  scalar gradient, so the peak is ``dW + dx + one chunk`` and no second copy of the gradients is
  made (``F.linear_cross_entropy``'s chunked path allocates the scaled gradients anew).
* Chunk size (``chunk_size="auto"``): the chunk's buffers get a memory budget, a fraction of the
  gradient bytes ``dW + dx`` bounded by a fraction of the device's free memory
  (:func:`~lightning_memkit.ops._cross_entropy_common.chunk_budget`); ``chunk_bytes`` overrides the
  budget and an integer ``chunk_size`` the rows.
* fp16/bf16 on CPU: the matmuls run in fp32 on fp32 copies of one chunk of ``hidden`` and one slab
  of ``weight`` rows at a time (CPUs without native bf16 matmul run them 4x to 100x slower in bf16).
  On fake tensors (a memory estimate) the slab loops, which only write into buffers allocated before
  them, run as one product each of the same dimensions: the same storages, the same FLOPs, a
  hundred times fewer ops to trace.
* ``reduction="none"``, and half inputs: forward keeps only the per-token log-sum-exp and backward
  recomputes the logits chunk by chunk (the upstream gradient is applied before the logits' gradient is
  rounded); on the half path (GEMMs in the head's dtype) slice by slice of the vocabulary instead, each
  slice's rows of ``dW`` written once (:mod:`~lightning_memkit.ops._vocab_backward`).
* No host syncs (except the optional target check, ``validate=True``). Inside ``torch.compile`` the
  op runs eagerly behind a graph break.

Example::

    >>> import torch
    >>> from lightning_memkit.ops import linear_cross_entropy
    >>> hidden = torch.randn(2, 8, 16, requires_grad=True)
    >>> head = torch.nn.Linear(16, 50, bias=False)
    >>> target = torch.randint(0, 50, (2, 8))
    >>> loss = linear_cross_entropy(hidden, head.weight, target, chunk_size=4)
    >>> loss.backward()
    >>> head.weight.grad.shape
    torch.Size([50, 16])
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.function import once_differentiable

from lightning_memkit.common.validation import check_bool, check_int
from lightning_memkit.measure.device import free_device_memory
from lightning_memkit.measure.fake_repeat import alike_runs, stands_for
from lightning_memkit.ops._cross_entropy_common import (
    ClassWeights,
    CrossEntropyOptions,
    budget_rows,
    check_backend,
    check_chunk_size,
    check_class_weights,
    check_target,
    chunk_budget,
    class_weighting,
    reduce_loss,
    row_floor,
    torch_rows,
    triton_kernels,
)
from lightning_memkit.ops._head_numerics import (
    HALF,
    check_logits_dtype,
    head_softcap,
    head_softcap_backward,
    native_half_matmul,
)
from lightning_memkit.ops._vocab_backward import block_rows, vocab_sliced_grads
from lightning_memkit.ops.cross_entropy import check_logits_target, kernel_args, scale_for_backward

__all__ = ["linear_cross_entropy"]

_disable_compile = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable
_ACCUM_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_MIXED_ADDMM_OK: dict[tuple, bool] = {}


def _addmm_into(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 1.0) -> None:
    """``acc = beta * acc + a @ b`` with ``acc`` possibly wider than ``a``/``b`` (fp32 accumulation of bf16; with
    ``beta=0`` the fp32 product of half operands, ``acc``'s old values ignored)."""
    if a.dtype == acc.dtype and b.dtype == acc.dtype:
        acc.addmm_(a, b, beta=beta)
        return
    key = (acc.device.type, a.dtype, acc.dtype)
    if acc.device.type == "cuda" and a.dtype == b.dtype and _MIXED_ADDMM_OK.get(key, True):
        try:
            torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)
            _MIXED_ADDMM_OK[key] = True
            return
        except (RuntimeError, TypeError):
            _MIXED_ADDMM_OK[key] = False
    acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta)


class _Setup(NamedTuple):
    """What a call fixes besides its tensors (checked before any work)."""

    o: CrossEntropyOptions
    backend: str
    plan: ChunkPlan
    accum_dtype: torch.dtype
    round_to: torch.dtype | None  # the logits and their gradient rounded to it; None: kept in float32
    class_weights: torch.Tensor | None
    keep_inputs: bool  # return_lse: the inputs are saved for the log-sum-exp's gradient
    accuracy: bool  # return_accuracy: each token's argmax compared with its target
    z_out: bool = False  # return_z_loss: the log-sum-exp handed out (not differentiable) for the z-loss's value
    predicted: bool = False  # return_predicted_tokens: each token's argmax kept
    token_scaling: bool = False  # each token's loss and gradient scaled by its target's detached probability


class _Chunker:
    """The per-chunk work shared by forward and the backward passes."""

    def __init__(self, x, weight, bias, target, setup: _Setup, weights: ClassWeights | None):
        o = setup.o
        self.x, self.w, self.b, self.t = x, weight, bias, target
        self.backend, self.rows, self.slab, self.accum_dtype = setup.backend, setup.plan.rows, setup.plan.slab, \
            setup.accum_dtype
        self.weights = weights
        n, v = x.shape[0], weight.shape[0]
        rows, dev = min(self.rows, max(n, 1)), x.device
        # softcap in the head's dtype (transformers' order of roundings) before the rows' math, which then has none
        self.cap = o.softcap if setup.round_to is not None else None
        self.o = o if self.cap is None else dataclasses.replace(o, softcap=None)
        # Triton reads logits in the compute dtype; the PyTorch path an fp32 chunk, or on the half path (the GEMMs in
        # the head's dtype) an fp32 block of ``plan.sub`` rows for the rows' math on the chunk in the head's dtype
        triton_half = self.backend == "triton" and setup.round_to is not None
        self.sub = setup.plan.sub
        zrows = min(self.sub, rows) if self.sub else rows
        self.buf = torch.empty(zrows, v, dtype=x.dtype if triton_half else torch.float32, device=dev)
        self.half = None if setup.round_to is None or triton_half else torch.empty(rows, v, dtype=x.dtype, device=dev)
        self.keep = self.whole = None
        if self.cap is not None:
            self.keep = torch.empty(rows, v, dtype=x.dtype, device=dev)
        elif self.backend == "torch" and o.softcap is not None:
            self.keep = torch.empty_like(self.buf)
        self.kargs = kernel_args(self.o)
        if self.slab:  # reused fp32 buffers (fresh allocations of this size cost page faults on every chunk)
            h = x.shape[1]
            self.xf = torch.empty(rows, h, dtype=torch.float32, device=dev)
            self.dxf = torch.empty_like(self.xf)
            self.wf = torch.empty(min(self.slab, v), h, dtype=torch.float32, device=dev)
            self.prod = torch.empty_like(self.wf) if self.accum_dtype != torch.float32 else None
            # fake tensors hold no values: the whole weight as rows of the slab buffer (a view, no storage) stands
            # for the slab loop in one product of the same dimensions
            self.whole = self.wf[:1].expand(v, h) if is_fake(x) else None

    def _slabs(self):
        if self.whole is not None:  # fake tensors: the one product stands for the loop
            return
        v = self.w.shape[0]
        for s in range(0, v, self.slab):
            e = min(s + self.slab, v)
            wf = self.wf[: e - s]
            wf.copy_(self.w[s:e])
            yield s, e, wf

    def logits(self, a: int, b: int) -> torch.Tensor:
        """The chunk's logits as the loss sees them (rounded and soft-capped in the head's dtype where asked)."""
        z = self.buf[: b - a]
        xc = self.x[a:b]
        if self.slab:  # fp16/bf16 on CPU: fp32 matmuls, one slab of weight rows at a time
            self._upcast_logits(xc, z)
        elif z.dtype == xc.dtype:  # fp32 inputs, or Triton's logits in the head's dtype
            self._product(xc, z)
        elif self.sub:  # a GEMM in the head's dtype, rounded once (as F.linear); the rows' math reads it in blocks
            z = self.half[: b - a]
            self._product(xc, z)
        else:  # float32 logits of half inputs, the products not rounded
            _addmm_into(z, xc, self.w.t(), beta=0.0)
            if self.b is not None:
                z.add_(self.b)
        return self._finish_logits(z, b - a)

    def _product(self, xc, out) -> None:
        if self.b is not None:
            torch.addmm(self.b.to(out.dtype), xc, self.w.t(), out=out)
        else:
            torch.mm(xc, self.w.t(), out=out)

    def _upcast_logits(self, xc, z) -> None:
        xf = self.xf[: xc.shape[0]]
        xf.copy_(xc)
        if self.whole is not None:
            torch.mm(xf, self.whole.t(), out=z)
        for s, e, wf in self._slabs():
            torch.mm(xf, wf.t(), out=z[:, s:e])
        if self.b is not None:
            z.add_(self.b)
        if self.half is not None:
            self.half[: xc.shape[0]].copy_(z)  # rounded once, as a GEMM in the head's dtype

    def _finish_logits(self, z, r: int) -> torch.Tensor:
        """Soft-cap the rounded logits in the head's dtype, then hand the loss its float32 (or Triton) chunk."""
        half = z if self.half is None or self.sub else self.half[:r]
        if self.cap is not None:
            head_softcap(half, self.cap, self.keep[:r])
        if half is not z:
            z.copy_(half)
        return z

    def loss_and_grad(self, z, a, b, *, grad_scale, lse=None, token_scale=None):
        """Fill ``z`` with the scaled gradient (if ``grad_scale``); return ``(loss, lse)`` rows (``token_scale``: the
        rows' buffer of target probabilities, token scaling's factors, filled with ``lse`` unknown)."""
        t = self.t[a:b]
        gs = None
        if grad_scale is not None:
            gs = grad_scale[a:b] if grad_scale.numel() > 1 else grad_scale
        if self.backend == "triton":
            loss = None if lse is not None else torch.empty(b - a, dtype=torch.float32, device=z.device)
            extra = {}
            if self.weights is not None:
                extra = dict(weight=self.weights.weight, weight_sum=self.weights.total, z_scale=self.weights.z_scale)
            out = triton_kernels().ce_rows(
                z, t, loss=loss, lse=lse, lse_known=lse is not None, grad=z if gs is not None else None,
                grad_scale=gs, token_scale=token_scale, **self.kargs, **extra,
            )
            return loss, out
        if self.sub:  # half inputs: forward only (no gradient built in forward, backward slices the vocabulary)
            assert gs is None and lse is None, "the half path's backward is vocab_sliced_grads"
            return self._blocked_rows(z, t, token_scale)
        keep = None if self.keep is None or self.cap is not None else self.keep[: b - a]
        return torch_rows(z, t, self.o, grad_scale=gs, lse=lse, keep=keep, weights=self.weights,
                          token_scale=token_scale)

    def _blocked_rows(self, z, t, token_scale=None):
        """Forward's :func:`torch_rows` on the chunk in the head's dtype, ``sub`` rows at a time through the fp32
        block; returns the chunk's ``(loss, lse)`` rows (backward on this path is
        :mod:`~lightning_memkit.ops._vocab_backward`'s)."""
        r = z.shape[0]
        loss = torch.empty(r, dtype=torch.float32, device=z.device)
        lse = torch.empty(r, dtype=torch.float32, device=z.device)
        # fake tensors (an estimate) hold no values: one block stands for the loop (the same storages, no GEMMs)
        for s in range(0, min(r, self.sub) if is_fake(z) else r, self.sub):
            e = min(s + self.sub, r)
            f = self.buf[: e - s]
            f.copy_(z[s:e])
            ts = None if token_scale is None else token_scale[s:e]
            loss[s:e], lse[s:e] = torch_rows(f, t[s:e], self.o, weights=self.weights, token_scale=ts)
        return loss, lse

    def gradient(self, z: torch.Tensor) -> torch.Tensor:
        """The chunk's gradient w.r.t. the logits as the head's backward products take it (``z`` holds it in fp32,
        or in the head's dtype on Triton): rounded to the head's dtype and through its softcap where asked."""
        r = z.shape[0]
        g = z if self.half is None or self.sub else self.half[:r]
        if g is not z:
            g.copy_(z)  # the rounding of the loss's float32 gradient to the head's dtype (``.float()``'s backward)
        if self.cap is not None:
            head_softcap_backward(g, self.cap, self.keep[:r])
        if self.slab and g is not z:
            z.copy_(g)  # the fp32 matmuls take the rounded values
            return z
        return g

    def accumulate(self, g, a, b, dx, dw, db, *, add: bool = False) -> None:
        """Turn the chunk gradient ``g`` (``dloss/dlogits``) into its share of ``dx``, ``dW``, ``db``."""
        if self.slab:
            self._accumulate_upcast(g, a, b, dx, dw, add)
        else:
            xc = self.x[a:b]
            if dx is not None:
                gw = g if g.dtype == self.w.dtype else g.to(self.w.dtype)
                if add:
                    dx[a:b].addmm_(gw, self.w)
                else:
                    torch.mm(gw, self.w, out=dx[a:b])
            if dw is not None:
                _addmm_into(dw, g.t(), xc)
        if db is not None:
            db.add_(g.sum(0, dtype=torch.float32))

    def _accumulate_upcast(self, g, a, b, dx, dw, add) -> None:
        xf, dxf = self.xf[: b - a], self.dxf[: b - a]
        dxf.zero_()
        if self.whole is not None:  # fake tensors: one product per loop product, the same dimensions and FLOPs
            if dx is not None:
                dxf.addmm_(g, self.whole)
            if dw is not None and self.prod is None:
                dw.addmm_(g.t(), xf)
            elif dw is not None:  # dW's (V, rows) x (rows, H) products into ``prod``: one (rows, H) x (H, V) into g
                torch.mm(xf, self.whole.t(), out=g)
        for s, e, wf in self._slabs():
            gs = g[:, s:e]
            if dx is not None:
                dxf.addmm_(gs, wf)
            if dw is not None:
                if self.prod is None:
                    dw[s:e].addmm_(gs.t(), xf)
                else:  # formed in fp32, rounded once into dW's dtype
                    prod = self.prod[: e - s]
                    torch.mm(gs.t(), xf, out=prod)
                    dw[s:e].add_(prod)
        if dx is not None and add:
            dx[a:b].add_(dxf)
        elif dx is not None:
            dx[a:b].copy_(dxf)

    def lse_gradient(self, z, a, b, lse, lse_grad) -> torch.Tensor:
        """The chunk's gradient of ``sum(lse * lse_grad)`` w.r.t. the logits (``z`` holds the logits)."""
        zf = z if z.dtype == torch.float32 else z.float()
        cap = self.o.softcap  # a float32 softcap of the rows' math (None when it ran in the head's dtype)
        th = None
        if cap is not None:
            th = torch.tanh(zf / cap)
            zf = th * cap
        valid = self.t[a:b] != self.o.ignore_index
        p = torch.exp(zf - lse.unsqueeze(1)) * torch.where(valid, lse_grad.to(torch.float32), 0.0).unsqueeze(1)
        if th is not None:
            p.mul_(1.0 - th * th)
        z.copy_(p)
        return self.gradient(z)


def _buffers(x, weight, bias, accum_dtype, need, zero=False):
    new = torch.zeros_like if zero else torch.empty_like
    dx = new(x) if need[0] else None
    dw = None
    if need[1]:
        dw = torch.zeros(weight.shape, dtype=accum_dtype, device=weight.device)
    # db costs V values: always accumulated in fp32 (or wider), cast at the end
    db_dtype = torch.promote_types(accum_dtype, torch.float32)
    db = torch.zeros(bias.shape, dtype=db_dtype, device=bias.device) if need[2] else None
    return dx, dw, db


def _finish(dw, db, weight_dtype, bias_dtype):
    if dw is not None and dw.dtype != weight_dtype:
        dw = dw.to(weight_dtype)
    if db is not None and db.dtype != bias_dtype:
        db = db.to(bias_dtype)
    return dw, db


def _lse_pass(ctx, x, weight, bias, t, lse, lse_grad, grads) -> None:
    """Add the gradient of the returned log-sum-exp (``lse_grad`` per token) into ``grads``: one recompute pass."""
    ch = _Chunker(x, weight, bias, t, ctx.setup, ctx.weights)
    rows = ctx.setup.plan.rows
    dx, dw, db = grads
    for a, count in alike_runs(x.shape[0], rows, is_fake(x)):
        b = min(a + rows, x.shape[0])
        with stands_for(count):
            g = ch.lse_gradient(ch.logits(a, b), a, b, lse[a:b], lse_grad[a:b])
            ch.accumulate(g, a, b, dx, dw, db, add=True)


def _flat_inputs(hidden: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden`` as contiguous ``(N, H)`` rows and ``target`` as contiguous ``(N,)``."""
    x = hidden.reshape(-1, hidden.shape[-1])
    if not x.is_contiguous():
        x = x.contiguous()
    return x, target.reshape(-1).contiguous()


def _needed_grads(needs_input_grad, grad_enabled: bool, bias) -> tuple[bool, bool, bool]:
    """Whether the gradients of ``hidden``, ``weight`` and ``bias`` are wanted."""
    ng = needs_input_grad
    return grad_enabled and ng[0], grad_enabled and ng[1], grad_enabled and bias is not None and ng[2]


def _row_outputs(n: int, setup: _Setup, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Forward's per-token buffers: loss and log-sum-exp rows, and (empty unless asked) the argmax's correctness,
    the predicted tokens and token scaling's factors."""
    loss_rows = torch.empty(n, dtype=torch.float32, device=device)
    lse = torch.empty(n, dtype=torch.float32, device=device)
    correct = torch.empty(n if setup.accuracy else 0, dtype=torch.bool, device=device)
    predicted = torch.empty(n if setup.predicted else 0, dtype=torch.long, device=device)
    scale = torch.empty(n if setup.token_scaling else 0, dtype=torch.float32, device=device)
    return loss_rows, lse, correct, predicted, scale


def _mask_ignored(correct, predicted, valid, setup: _Setup, shape) -> torch.Tensor:
    """Mark the ignored tokens wrong in ``correct`` (in place) and -1 in ``predicted``; return ``predicted``."""
    if setup.accuracy:
        correct &= valid
    if setup.predicted:
        predicted = torch.where(valid, predicted, -1).reshape(shape)
    return predicted


def _keep_for_backward(ctx, setup: _Setup, in_forward, need, hidden, weight, bias, weights, base, scale, grads,
                       saved) -> None:
    """Store on ``ctx`` what backward reads: the setup, the gradients built in forward, or the saved inputs."""
    ctx.setup, ctx.in_forward, ctx.need, ctx.hidden_shape = setup, in_forward, need, hidden.shape
    ctx.weights, ctx.base, ctx.token_scale = weights, base, scale if setup.token_scaling else None
    ctx.weight_dtype, ctx.bias_dtype = weight.dtype, None if bias is None else bias.dtype
    ctx.grads = grads if in_forward else None
    if any(need) and (not in_forward or setup.keep_inputs):
        ctx.save_for_backward(*saved)
    ctx.set_materialize_grads(False)


def _lse_output(lse, valid, setup: _Setup, shape) -> torch.Tensor:
    """The log-sum-exp handed out (0 at ignored tokens) when returned or needed for the z-loss, else empty."""
    if setup.keep_inputs or setup.z_out:
        return torch.where(valid, lse, 0.0).reshape(shape)
    return lse.new_empty(0)


class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, setup, grad_enabled, loss_dtype):
        o = setup.o
        x, t = _flat_inputs(hidden, target)
        n = x.shape[0]
        need = _needed_grads(ctx.needs_input_grad, grad_enabled, bias)
        # gradients built in forward assume an upstream gradient of 1 (scaled afterwards): exact for float32 inputs;
        # half inputs recompute in backward, so the logits' gradient is scaled before its rounding, as unfused
        in_forward = any(need) and o.reduction != "none" and hidden.dtype not in HALF
        weights, denom, base = class_weighting(setup.class_weights, t, o)
        ch = _Chunker(x, weight, bias, t, setup, weights)
        loss_rows, lse, correct, predicted, scale = _row_outputs(n, setup, x.device)
        dx, dw, db = _buffers(x, weight, bias, setup.accum_dtype, need) if in_forward else (None, None, None)
        # fake tensors (an estimate): the chunks of full rows are alike, one stands for them all (fake_repeat)
        for a, count in alike_runs(n, setup.plan.rows, is_fake(x)):
            b = min(a + setup.plan.rows, n)
            with stands_for(count):
                z = ch.logits(a, b)
                if setup.accuracy or setup.predicted:  # the logits as the loss sees them, before the rows' math
                    top = z.argmax(1)
                    if setup.accuracy:
                        correct[a:b] = top == t[a:b]
                    if setup.predicted:
                        predicted[a:b] = top
                loss_c, lse_c = ch.loss_and_grad(z, a, b, grad_scale=base if in_forward else None,
                                                 token_scale=scale[a:b] if setup.token_scaling else None)
                loss_rows[a:b] = loss_c
                lse[a:b] = lse_c
                if in_forward:
                    ch.accumulate(ch.gradient(z), a, b, dx, dw, db)
        del ch
        valid = t != o.ignore_index
        predicted = _mask_ignored(correct, predicted, valid, setup, target.shape)
        _keep_for_backward(ctx, setup, in_forward, need, hidden, weight, bias, weights, base, scale, (dx, dw, db),
                           (x, weight, bias, t, lse))
        lse_out = _lse_output(lse, valid, setup, target.shape)
        if not setup.keep_inputs:
            ctx.mark_non_differentiable(lse_out)
        ctx.mark_non_differentiable(correct, predicted, scale)
        return reduce_loss(loss_rows, o, denom, target.shape, loss_dtype), lse_out, correct, predicted, scale

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_lse, _grad_correct, _grad_predicted, _grad_scale):
        if ctx.in_forward:
            grads = _forward_grads(ctx, grad_out)
        else:
            grads = _recomputed_grads(ctx, grad_out)
        if grad_lse is not None and any(ctx.need):
            x, weight, bias, t, lse = ctx.saved_tensors
            _lse_pass(ctx, x, weight, bias, t, lse, grad_lse.reshape(-1), grads)
        dx, dw, db = grads
        dw, db = _finish(dw, db, ctx.weight_dtype, ctx.bias_dtype)
        if dx is not None:
            dx = dx.view(ctx.hidden_shape)
        return dx, dw, db, None, None, None, None


def _forward_grads(ctx, grad_out):
    """The gradients built in forward, scaled in place by the loss's upstream gradient (0 when it has none)."""
    if ctx.grads is None:
        raise RuntimeError(
            "linear_cross_entropy with reduction='mean'/'sum' can be differentiated once: its gradients "
            "were computed in forward and have been handed out"
        )
    grads, ctx.grads = ctx.grads, None
    for g in grads:
        if g is not None and grad_out is None:
            g.zero_()
        elif g is not None:
            g.mul_(grad_out)
    return grads


def _recomputed_grads(ctx, grad_out):
    """``reduction="none"`` (and half inputs): the gradients, recomputing the logits chunk by chunk (on the half
    path slice by slice of the vocabulary, :mod:`~lightning_memkit.ops._vocab_backward`)."""
    x, weight, bias, t, lse = ctx.saved_tensors
    setup = ctx.setup
    if grad_out is None:
        return _buffers(x, weight, bias, setup.accum_dtype, ctx.need, zero=True)
    scale = scale_for_backward(grad_out, ctx.base, setup.o.reduction)
    if ctx.token_scale is not None:  # token scaling's detached factors, found in forward
        scale = scale * ctx.token_scale
    if setup.plan.cols:
        block = block_rows(x.shape[0], setup.plan.cols, SUB_BLOCK_BYTES, MIN_SUB_ROWS)
        return vocab_sliced_grads(x, weight, bias, t, lse, scale, setup, ctx.weights, ctx.need, block=block)
    grads = _buffers(x, weight, bias, setup.accum_dtype, ctx.need)
    dx, dw, db = grads
    ch = _Chunker(x, weight, bias, t, setup, ctx.weights)
    for a, count in alike_runs(x.shape[0], setup.plan.rows, is_fake(x)):
        b = min(a + setup.plan.rows, x.shape[0])
        with stands_for(count):
            z = ch.logits(a, b)
            ch.loss_and_grad(z, a, b, grad_scale=scale, lse=lse[a:b])
            ch.accumulate(ch.gradient(z), a, b, dx, dw, db)
    return grads


def _check_inputs(hidden, weight, bias, target, accum_dtype) -> None:
    check_logits_target(hidden, target, "hidden")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D (V, H) tensor, got {getattr(weight, 'shape', type(weight))}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} must be (V, H) with H = hidden.shape[-1] = {hidden.shape[-1]}"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must equal hidden dtype {hidden.dtype} (or use autocast)")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {getattr(bias, 'shape', type(bias))}")
        if bias.dtype != weight.dtype or bias.device != weight.device:
            raise TypeError(f"bias must match weight's dtype and device, got {bias.dtype} on {bias.device}")
    if accum_dtype is not None and accum_dtype not in _ACCUM_DTYPES:
        raise TypeError(f"accum_dtype must be None (the weight's dtype) or one of {_ACCUM_DTYPES}, got {accum_dtype!r}")


class ChunkPlan(NamedTuple):
    """Rows of ``hidden`` per chunk, rows of ``weight`` per fp32 slab (0: no upcast, whole-weight matmuls), and on
    the half path (GEMMs in the head's dtype on the PyTorch backend) the rows of each fp32 block of the rows' math
    and the classes per slice of the vocabulary in backward (0: not that path)."""

    rows: int
    slab: int
    sub: int = 0
    cols: int = 0


#: bytes of the half path's fp32 block: small enough to stay in a CPU core's cache between its passes, and at
#: least ``MIN_SUB_ROWS`` rows (fewer ops per chunk with wide vocabularies: 4% faster at V=128,256)
SUB_BLOCK_BYTES = 2 * 2**20
MIN_SUB_ROWS = 16
#: the fewest classes of a backward slice on the half path (a budget too small for them runs one-row GEMMs)
MIN_SLICE_COLS = 16


def _upcast(x: torch.Tensor, backend: str, round_to: torch.dtype | None) -> bool:
    """fp32 matmuls on fp32 copies: half inputs on a CPU, for float32 logits or where half GEMMs are emulated."""
    if backend != "torch" or x.device.type != "cpu" or x.dtype not in HALF:
        return False
    return round_to is None or not native_half_matmul(x.dtype)


def _row_bytes(hidden, v: int, o, backend: str, round_to) -> tuple[int, int]:
    """``(logits, all)``: bytes per chunk row of the logits buffer, and of every per-row buffer of a chunk."""
    half = hidden.element_size()
    logit = v * (half if backend == "triton" and round_to is not None else 4)
    extra = 0
    if o.softcap is not None:  # softcap's saved tanh: in the head's dtype, or fp32 on the PyTorch path
        extra += v * half if round_to is not None else (4 * v if backend == "torch" else 0)
    if round_to is not None and backend == "torch":  # the chunk in the head's dtype (GEMM output, rounding)
        extra += v * half
    return logit, logit + extra


def chunk_plan(hidden, weight, n_rows, o, backend, chunk_size, chunk_bytes, round_to=None) -> ChunkPlan:
    """The chunk rows (and fp32 weight slab rows on the CPU upcast path) for ``linear_cross_entropy``."""
    h, v = weight.shape[1], weight.shape[0]
    auto = chunk_size == "auto" and chunk_bytes is None
    free = free_device_memory(hidden.device) if auto else None
    if chunk_bytes is None:
        grad_bytes = (weight.numel() + n_rows * h) * hidden.element_size()
        chunk_bytes = chunk_budget(grad_bytes, o.reduction, free)
    logit_row_bytes, row_bytes = _row_bytes(hidden, v, o, backend, round_to)
    slab = sub = 0
    if _upcast(hidden, backend, round_to):
        slab = max(16, chunk_bytes // 8 // (2 * 4 * h))  # two fp32 slab temporaries: an eighth of the budget
        chunk_bytes -= 2 * 4 * h * min(slab, v)
        row_bytes += 2 * 4 * h  # the chunk's fp32 hidden and dx rows
    elif backend == "torch" and round_to is not None:  # the half path: the chunk in the head's dtype, an fp32 block
        sub = max(1, min(n_rows, max(MIN_SUB_ROWS, SUB_BLOCK_BYTES // (4 * v))))
        chunk_bytes -= sub * v * 4
        row_bytes -= 4 * v
    if chunk_size != "auto":
        rows = int(chunk_size)
    else:
        rows = budget_rows(chunk_bytes, row_bytes, n_rows)
        if auto and not sub:  # tall GEMMs where their logits cost at most dW + dx and a quarter of the free memory
            rows = max(rows, row_floor(o.reduction, logit_row_bytes, row_bytes, grad_bytes, free))
    rows = max(1, min(rows, n_rows))
    cols = _slice_cols(rows, n_rows, v, h, chunk_size, chunk_bytes, row_bytes) if sub else 0
    return ChunkPlan(rows, slab, sub, cols)


def _slice_cols(rows: int, n_rows: int, v: int, h: int, chunk_size, chunk_bytes: int, row_bytes: int) -> int:
    """Classes per backward slice on the half path: with rows given, as many bytes as the forward chunk (``rows`` of
    ``v`` classes); with ``"auto"`` the budget less the float32 ``dx`` accumulator beyond ``dx`` (4 bytes per
    element), rounded down to a multiple of 16 from 32 classes up, at least :data:`MIN_SLICE_COLS`."""
    if chunk_size != "auto":
        return max(1, min(v, rows * v // n_rows))
    cols = budget_rows(chunk_bytes - 4 * n_rows * h, n_rows * (row_bytes // v), v)
    return max(cols, min(v, MIN_SLICE_COLS))


def _shifted(target: torch.Tensor, shift: int, ignore_index: int) -> torch.Tensor:
    """``target`` moved ``shift`` steps left along its last dimension, the freed end ignored (no copy of hidden)."""
    if not shift:
        return target
    if target.dim() == 0 or target.shape[-1] <= shift:
        raise ValueError(f"linear_cross_entropy: shift={shift} needs a target whose last (time) dimension is longer "
                         f"than {shift}, got shape {tuple(target.shape)}")
    return torch.nn.functional.pad(target[..., shift:], (0, shift), value=ignore_index)


def _check_shift(shift) -> int:
    if isinstance(shift, bool):
        return int(shift)
    check_int(shift, "shift", minimum=0, owner="linear_cross_entropy")
    return int(shift)


def _accuracy(correct: torch.Tensor, target: torch.Tensor, o: CrossEntropyOptions) -> torch.Tensor:
    """Token accuracy of the argmax against ``target``: 0/1 per token for ``"none"``, else the fraction of the kept
    tokens (Liger-Kernel's, under ``"sum"`` too; 0 when every token is ignored)."""
    if o.reduction == "none":
        return correct.reshape(target.shape).to(torch.float32)
    return correct.sum().to(torch.float32) / _kept(target, o)


def _trim(t: torch.Tensor, shift: int) -> torch.Tensor:
    return t[..., : t.shape[-1] - shift] if shift else t


@_disable_compile
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    class_weights: torch.Tensor | None = None,
    shift: int | bool = 0,
    logits_dtype: torch.dtype | str = torch.float32,
    token_scaling: bool = False,
    return_lse: bool = False,
    return_accuracy: bool = False,
    return_z_loss: bool = False,
    return_predicted_tokens: bool = False,
    chunk_size: int | str = "auto",
    chunk_bytes: int | None = None,
    accum_dtype: torch.dtype | None = None,
    validate: bool = True,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``target`` without materializing the logits.

    Args:
        hidden: ``(..., H)`` activations entering the LM head.
        weight: ``(V, H)`` head weight (``nn.Linear(H, V).weight``).
        target: ``(...)`` class indices aligned with ``hidden`` (see ``shift``).
        bias: optional ``(V,)`` head bias.
        ignore_index, label_smoothing, z_loss, softcap, reduction, validate, backend: as in
            :func:`~lightning_memkit.ops.cross_entropy`.
        class_weights: optional ``(V,)`` weight per class, as ``F.cross_entropy``'s ``weight``: each token's
            loss is scaled by its target's weight and ``"mean"`` divides by the kept targets' summed weight;
            the z-loss stays unweighted, divided by their count (Liger-Kernel's ``ce_weight``).
        shift: ``k > 0`` (or ``True``: 1) predicts ``target[..., i + k]`` from ``hidden[..., i, :]`` along the
            last dimension of ``target`` (causal LM training on unshifted labels, Cut Cross-Entropy's ``shift``);
            the last ``k`` positions take no loss, and per-token outputs have ``k`` fewer positions.
        logits_dtype: ``torch.float32`` (default, or ``"float32"``): the logits and their gradient stay float32,
            bias, ``softcap`` and the log-sum-exp included (Cut Cross-Entropy's numerics; Liger-Kernel's softcap
            and log-sum-exp too); ``"head"`` (or the inputs' dtype): for bf16/fp16 inputs each logit is rounded
            to that dtype (softcap applied in it) and its gradient rounded to it before the head's backward
            products, as ``F.cross_entropy(F.linear(hidden, weight).float(), target)`` (transformers, the
            default of :func:`~lightning_memkit.hf.fused_linear_cross_entropy`). Same result for float32 inputs.
        token_scaling: scale each token's loss (z-loss and smoothing included) and its gradient by the predicted
            probability of its target, ``softmax(logits)[target]`` of the logits as the loss sees them, detached
            (Liger-Kernel's ``use_token_scaling``); ``"mean"`` still divides by the kept tokens' count (or weight).
        return_lse: also return each token's log-sum-exp (float32, ``target``'s shape, 0 where ignored),
            differentiable (for a custom z-loss; its gradient costs one more pass over the chunks, and
            ``hidden`` is kept for it).
        return_accuracy: also return the token accuracy, the argmax of the logits against ``target`` over the
            kept tokens: the fraction of them for ``"mean"`` and ``"sum"`` (Liger-Kernel's), 0/1 per token for
            ``"none"``; computed chunk by chunk (no logits), not differentiable.
        return_z_loss: also return the z-loss term the loss includes, ``z_loss * lse**2`` per kept token, reduced
            as the loss reduces it (``"mean"``: over the kept tokens' count, unweighted), float32, not
            differentiable (Liger-Kernel's ``return_z_loss``: for logging; it is already in the loss).
        return_predicted_tokens: also return each token's argmax class (``target``'s shape less ``shift``, int64,
            -1 where the target is ignored), computed chunk by chunk (no logits), not differentiable
            (Liger-Kernel's ``return_predicted_tokens``).
        chunk_size: tokens per chunk, or ``"auto"``: as many tokens as the chunk budget holds in
            buffers (fp32 logits; twice that with ``softcap`` on the PyTorch path).
        chunk_bytes: the chunk budget in bytes. ``None`` (default): a fifth of the bytes of
            ``dW + dx`` (an eighth with ``reduction="none"``), at most a quarter of the device's free
            memory, at least 1 MiB; with ``"mean"``/``"sum"`` at least 448 rows where 448 rows of logits
            cost at most ``dW + dx`` and a quarter of the free memory holds them. Only with
            ``chunk_size="auto"``.
        accum_dtype: dtype in which ``dW`` accumulates across chunks. ``None`` (default): the
            weight's dtype, each chunk's product formed in fp32 and rounded once into it (no fp32
            copy of ``dW``; in bf16 the rounding error grows with the number of chunks, so with a
            budget that forces many chunks prefer ``torch.float32``); ``torch.float32`` keeps an
            fp32 accumulator, cast at the end. ``db`` always accumulates in fp32.

    Returns the loss, float32 for half inputs (the peers' dtype; at least the inputs' and ``accum_dtype``'s
    precision otherwise); with ``return_lse``, ``return_accuracy``, ``return_z_loss`` and/or
    ``return_predicted_tokens`` the tuple of the loss and those asked, in that order (``(loss, lse)``,
    ``(loss, accuracy, z_loss)``, ...). The gradients keep the inputs' dtypes.
    Under ``torch.autocast`` the inputs are cast to the autocast dtype first, like ``F.linear``.
    With ``reduction="mean"``/``"sum"`` the graph can be differentiated once (gradients are built in
    forward); ``reduction="none"`` recomputes in backward and supports ``retain_graph``.

    Example::

        >>> import torch
        >>> hidden = torch.randn(10, 16, requires_grad=True)
        >>> weight = torch.randn(300, 16, requires_grad=True)
        >>> target = torch.randint(0, 300, (10,))
        >>> loss = linear_cross_entropy(hidden, weight, target, z_loss=1e-4, chunk_size=4)
        >>> loss.backward()
        >>> loss, accuracy = linear_cross_entropy(hidden.detach(), weight.detach(), target, return_accuracy=True)
        >>> 0.0 <= float(accuracy) <= 1.0
        True
    """
    o = CrossEntropyOptions(ignore_index, label_smoothing, z_loss, softcap, reduction)
    check_chunk_size(chunk_size)
    check_int(chunk_bytes, "chunk_bytes", minimum=1, allow_none=True, owner="linear_cross_entropy")
    if chunk_bytes is not None and chunk_size != "auto":
        raise ValueError(f"linear_cross_entropy: give chunk_size={chunk_size!r} (rows) or chunk_bytes={chunk_bytes} "
                         "(a byte budget), not both")
    shift = _check_shift(shift)
    check_bool(return_lse, "return_lse", owner="linear_cross_entropy")
    check_bool(return_accuracy, "return_accuracy", owner="linear_cross_entropy")
    check_bool(return_z_loss, "return_z_loss", owner="linear_cross_entropy")
    check_bool(return_predicted_tokens, "return_predicted_tokens", owner="linear_cross_entropy")
    check_bool(token_scaling, "token_scaling", owner="linear_cross_entropy")
    dev_type = hidden.device.type if isinstance(hidden, torch.Tensor) else "cpu"
    if isinstance(hidden, torch.Tensor) and torch.is_autocast_enabled(dev_type):
        dt = torch.get_autocast_dtype(dev_type)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = None if bias is None else bias.to(dt)
    _check_inputs(hidden, weight, bias, target, accum_dtype)
    check_class_weights(class_weights, weight.shape[0], hidden.device)
    round_to = check_logits_dtype(logits_dtype, hidden.dtype, "linear_cross_entropy")
    impl = check_backend(backend, hidden.device)
    if validate:
        check_target(target, weight.shape[0], ignore_index)
    target = _shifted(target, shift, ignore_index)
    plan = chunk_plan(hidden, weight, max(1, target.numel()), o, impl, chunk_size, chunk_bytes, round_to)
    accum = weight.dtype if accum_dtype is None else accum_dtype
    loss_dtype = torch.promote_types(hidden.dtype, torch.float32)  # float32 for half inputs, as the peers return
    if accum_dtype is not None:
        loss_dtype = torch.promote_types(loss_dtype, accum_dtype)
    setup = _Setup(o, impl, plan, accum, round_to, class_weights, return_lse, return_accuracy, return_z_loss,
                   return_predicted_tokens, token_scaling)
    with torch.autocast(dev_type, enabled=False):
        loss, lse, correct, predicted, scale = _LinearCrossEntropyFunction.apply(
            hidden, weight, bias, target, setup, torch.is_grad_enabled(), loss_dtype
        )
    if reduction == "none":
        loss = _trim(loss, shift)
    extras = [_trim(lse, shift)] if return_lse else []
    if return_accuracy:
        extras.append(_trim(_accuracy(correct, target, o), shift) if reduction == "none"
                      else _accuracy(correct, target, o))
    if return_z_loss:
        extras.append(_z_loss_term(lse.detach(), scale if token_scaling else None, target, o, shift))
    if return_predicted_tokens:
        extras.append(_trim(predicted, shift))
    return (loss, *extras) if extras else loss


def _z_loss_term(lse, scale, target: torch.Tensor, o: CrossEntropyOptions, shift: int) -> torch.Tensor:
    """The z-loss the loss includes (``lse`` is 0 at ignored tokens; ``scale``: token scaling's factors, or None),
    reduced as the loss: unweighted, the mean over the kept tokens' count."""
    rows = o.z_loss * lse.square()
    if scale is not None:
        rows = rows * scale.reshape(rows.shape)
    if o.reduction == "none":
        return _trim(rows, shift)
    total = rows.sum()
    return total if o.reduction == "sum" else total / _kept(target, o)


def _kept(target: torch.Tensor, o: CrossEntropyOptions) -> torch.Tensor:
    """The number of kept (not ignored) targets, at least 1, as float32: the denominator of the unweighted means."""
    return (target != o.ignore_index).sum().clamp_min(1).to(torch.float32)
