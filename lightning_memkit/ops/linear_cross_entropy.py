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
* ``reduction="none"``: ``dW`` depends on the per-token upstream gradients, so forward keeps only
  the per-token log-sum-exp and backward recomputes the logits chunk by chunk.
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

from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.function import once_differentiable

from lightning_memkit.common.validation import check_int
from lightning_memkit.measure.device import free_device_memory
from lightning_memkit.ops._cross_entropy_common import (
    CrossEntropyOptions,
    budget_rows,
    check_backend,
    check_chunk_size,
    check_target,
    chunk_budget,
    grad_base_scale,
    reduce_loss,
    row_floor,
    torch_rows,
    triton_kernels,
)
from lightning_memkit.ops.cross_entropy import check_logits_target, kernel_args, scale_for_backward

__all__ = ["linear_cross_entropy"]

_disable_compile = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable
_ACCUM_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_MIXED_ADDMM_OK: dict[tuple, bool] = {}


def _addmm_into(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` possibly wider than ``a``/``b`` (fp32 accumulation of bf16)."""
    if a.dtype == acc.dtype and b.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    key = (acc.device.type, a.dtype, acc.dtype)
    if acc.device.type == "cuda" and a.dtype == b.dtype and _MIXED_ADDMM_OK.get(key, True):
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            _MIXED_ADDMM_OK[key] = True
            return
        except (RuntimeError, TypeError):
            _MIXED_ADDMM_OK[key] = False
    acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


class _Chunker:
    """The per-chunk work shared by forward and the ``reduction="none"`` backward."""

    def __init__(self, x, weight, bias, target, o, backend, plan, accum_dtype):
        self.x, self.w, self.b, self.t, self.o = x, weight, bias, target, o
        self.backend, self.rows, self.slab, self.accum_dtype = backend, plan.rows, plan.slab, accum_dtype
        n, v = x.shape[0], weight.shape[0]
        dev = x.device
        # Triton works on logits in the compute dtype; the PyTorch path on an fp32 chunk.
        zdtype = x.dtype if backend == "triton" else torch.float32
        self.buf = torch.empty(min(self.rows, max(n, 1)), v, dtype=zdtype, device=dev)
        self.keep = self.whole = None
        if backend == "torch" and o.softcap is not None:
            self.keep = torch.empty_like(self.buf)
        self.kargs = kernel_args(o)
        if self.slab:  # reused fp32 buffers (fresh allocations of this size cost page faults on every chunk)
            h, rows = x.shape[1], self.buf.shape[0]
            self.xf = torch.empty(rows, h, dtype=torch.float32, device=dev)
            self.dxf = torch.empty_like(self.xf)
            self.wf = torch.empty(min(self.slab, v), h, dtype=torch.float32, device=dev)
            self.prod = torch.empty_like(self.wf) if accum_dtype != torch.float32 else None
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
        z = self.buf[: b - a]
        xc = self.x[a:b]
        if self.slab:  # fp16/bf16 on CPU: fp32 matmuls, one slab of weight rows at a time
            xf = self.xf[: b - a]
            xf.copy_(xc)
            if self.whole is not None:
                torch.mm(xf, self.whole.t(), out=z)
            for s, e, wf in self._slabs():
                torch.mm(xf, wf.t(), out=z[:, s:e])
            if self.b is not None:
                z.add_(self.b)
        elif z.dtype == xc.dtype:
            if self.b is not None:
                torch.addmm(self.b.to(z.dtype), xc, self.w.t(), out=z)
            else:
                torch.mm(xc, self.w.t(), out=z)
        else:
            z.copy_(torch.mm(xc, self.w.t()))
            if self.b is not None:
                z.add_(self.b)
        return z

    def loss_and_grad(self, z, a, b, *, grad_scale, lse=None):
        """Fill ``z`` with the scaled gradient (if ``grad_scale``); return ``(loss, lse)`` rows."""
        t = self.t[a:b]
        gs = None
        if grad_scale is not None:
            gs = grad_scale[a:b] if grad_scale.numel() > 1 else grad_scale
        if self.backend == "triton":
            loss = None if lse is not None else torch.empty(b - a, dtype=torch.float32, device=z.device)
            out = triton_kernels().ce_rows(
                z, t, loss=loss, lse=lse, lse_known=lse is not None, grad=z if gs is not None else None,
                grad_scale=gs, **self.kargs,
            )
            return loss, out
        keep = None if self.keep is None else self.keep[: b - a]
        return torch_rows(z, t, self.o, grad_scale=gs, lse=lse, keep=keep)

    def accumulate(self, g, a, b, dx, dw, db) -> None:
        """Turn the chunk gradient ``g`` (``dloss/dlogits``) into its share of ``dx``, ``dW``, ``db``."""
        if self.slab:
            self._accumulate_upcast(g, a, b, dx, dw)
        else:
            xc = self.x[a:b]
            if dx is not None:
                if g.dtype == self.w.dtype:
                    torch.mm(g, self.w, out=dx[a:b])
                else:
                    dx[a:b] = torch.mm(g.to(self.w.dtype), self.w)
            if dw is not None:
                _addmm_into(dw, g.t(), xc)
        if db is not None:
            db.add_(g.sum(0, dtype=torch.float32))

    def _accumulate_upcast(self, g, a, b, dx, dw) -> None:
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
        if dx is not None:
            dx[a:b].copy_(dxf)


def _buffers(x, weight, bias, accum_dtype, need):
    dx = torch.empty_like(x) if need[0] else None
    dw = torch.zeros(weight.shape, dtype=accum_dtype, device=weight.device) if need[1] else None
    # db costs V values: always accumulated in fp32 (or wider), cast at the end
    db_dtype = torch.promote_types(accum_dtype, torch.float32)
    db = torch.zeros(bias.shape, dtype=db_dtype, device=bias.device) if need[2] else None
    return dx, dw, db


def _finish(dw, db, weight, bias):
    if dw is not None and dw.dtype != weight.dtype:
        dw = dw.to(weight.dtype)
    if db is not None and db.dtype != bias.dtype:
        db = db.to(bias.dtype)
    return dw, db


class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, o, backend, plan, accum_dtype, grad_enabled, loss_dtype):
        h = hidden.shape[-1]
        x = hidden.reshape(-1, h)
        if not x.is_contiguous():
            x = x.contiguous()
        t = target.reshape(-1).contiguous()
        n = x.shape[0]
        ng = ctx.needs_input_grad
        need = (grad_enabled and ng[0], grad_enabled and ng[1], grad_enabled and bias is not None and ng[2])
        in_forward = any(need) and o.reduction != "none"
        n_valid, base = grad_base_scale(t, o)
        ch = _Chunker(x, weight, bias, t, o, backend, plan, accum_dtype)
        rows = plan.rows
        loss_rows = torch.empty(n, dtype=torch.float32, device=x.device)
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        dx, dw, db = _buffers(x, weight, bias, accum_dtype, need) if in_forward else (None, None, None)
        for a in range(0, n, rows):
            b = min(a + rows, n)
            z = ch.logits(a, b)
            loss_c, lse_c = ch.loss_and_grad(z, a, b, grad_scale=base if in_forward else None)
            loss_rows[a:b] = loss_c
            lse[a:b] = lse_c
            if in_forward:
                ch.accumulate(z, a, b, dx, dw, db)
        del ch
        ctx.o, ctx.backend, ctx.plan, ctx.accum_dtype = o, backend, plan, accum_dtype
        ctx.in_forward, ctx.need, ctx.hidden_shape = in_forward, need, hidden.shape
        if in_forward:
            ctx.grads = (dx, dw, db)
            ctx.weight_dtype = weight.dtype
            ctx.bias_dtype = None if bias is None else bias.dtype
        elif any(need):
            ctx.save_for_backward(x, weight, bias, t, lse)
        return reduce_loss(loss_rows, o, n_valid, target.shape, loss_dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        if ctx.in_forward:
            if ctx.grads is None:
                raise RuntimeError(
                    "linear_cross_entropy with reduction='mean'/'sum' can be differentiated once: its gradients "
                    "were computed in forward and have been handed out"
                )
            dx, dw, db = ctx.grads
            ctx.grads = None
            for g in (dx, dw, db):
                if g is not None:
                    g.mul_(grad_out)
            if dw is not None and dw.dtype != ctx.weight_dtype:
                dw = dw.to(ctx.weight_dtype)
            if db is not None and db.dtype != ctx.bias_dtype:
                db = db.to(ctx.bias_dtype)
        else:
            x, weight, bias, t, lse = ctx.saved_tensors
            o, rows = ctx.o, ctx.plan.rows
            scale = scale_for_backward(grad_out, None, o.reduction)
            ch = _Chunker(x, weight, bias, t, o, ctx.backend, ctx.plan, ctx.accum_dtype)
            dx, dw, db = _buffers(x, weight, bias, ctx.accum_dtype, ctx.need)
            for a in range(0, x.shape[0], rows):
                b = min(a + rows, x.shape[0])
                z = ch.logits(a, b)
                ch.loss_and_grad(z, a, b, grad_scale=scale, lse=lse[a:b])
                ch.accumulate(z, a, b, dx, dw, db)
            del ch
            dw, db = _finish(dw, db, weight, bias)
        if dx is not None:
            dx = dx.view(ctx.hidden_shape)
        return dx, dw, db, None, None, None, None, None, None, None


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
    """Rows of ``hidden`` per chunk, and rows of ``weight`` per fp32 slab (0: no upcast, whole-weight matmuls)."""

    rows: int
    slab: int


def _upcast(x: torch.Tensor, backend: str) -> bool:
    return backend == "torch" and x.device.type == "cpu" and x.dtype in (torch.float16, torch.bfloat16)


def chunk_plan(hidden, weight, n_rows, o, backend, chunk_size, chunk_bytes) -> ChunkPlan:
    """The chunk rows (and fp32 weight slab rows on the CPU fp16/bf16 path) for ``linear_cross_entropy``."""
    h, v = weight.shape[1], weight.shape[0]
    auto = chunk_size == "auto" and chunk_bytes is None
    free = free_device_memory(hidden.device) if auto else None
    if chunk_bytes is None:
        grad_bytes = (weight.numel() + n_rows * h) * hidden.element_size()
        chunk_bytes = chunk_budget(grad_bytes, o.reduction, free)
    # bytes per row of the chunk buffers: fp32 logits (the compute dtype on Triton), a second fp32 buffer for
    # softcap's derivative on the PyTorch path, and on the upcast path the chunk's fp32 hidden and dx rows
    logit_row_bytes = row_bytes = v * (hidden.element_size() if backend == "triton" else 4)
    if backend == "torch" and o.softcap is not None:
        row_bytes *= 2
    slab = 0
    if _upcast(hidden, backend):
        slab = max(16, chunk_bytes // 8 // (2 * 4 * h))  # two fp32 slab temporaries: an eighth of the budget
        chunk_bytes -= 2 * 4 * h * min(slab, v)
        row_bytes += 2 * 4 * h
    if chunk_size != "auto":
        rows = int(chunk_size)
    else:
        rows = budget_rows(chunk_bytes, row_bytes, n_rows)
        if auto:  # tall GEMMs where their logits cost at most dW + dx and a quarter of the free memory holds them
            rows = max(rows, row_floor(o.reduction, logit_row_bytes, row_bytes, grad_bytes, free))
    return ChunkPlan(max(1, min(rows, n_rows)), slab)


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
    chunk_size: int | str = "auto",
    chunk_bytes: int | None = None,
    accum_dtype: torch.dtype | None = None,
    validate: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``target`` without materializing the logits.

    Args:
        hidden: ``(..., H)`` activations entering the LM head.
        weight: ``(V, H)`` head weight (``nn.Linear(H, V).weight``).
        target: ``(...)`` class indices aligned with ``hidden`` (nothing is shifted here).
        bias: optional ``(V,)`` head bias.
        ignore_index, label_smoothing, z_loss, softcap, reduction, validate, backend: as in
            :func:`~lightning_memkit.ops.cross_entropy`.
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

    The loss is float32 for half inputs (the peers' dtype; at least the inputs' and ``accum_dtype``'s
    precision otherwise); the gradients keep the inputs' dtypes.
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
    """
    o = CrossEntropyOptions(ignore_index, label_smoothing, z_loss, softcap, reduction)
    check_chunk_size(chunk_size)
    check_int(chunk_bytes, "chunk_bytes", minimum=1, allow_none=True, owner="linear_cross_entropy")
    if chunk_bytes is not None and chunk_size != "auto":
        raise ValueError(f"linear_cross_entropy: give chunk_size={chunk_size!r} (rows) or chunk_bytes={chunk_bytes} "
                         "(a byte budget), not both")
    dev_type = hidden.device.type if isinstance(hidden, torch.Tensor) else "cpu"
    if isinstance(hidden, torch.Tensor) and torch.is_autocast_enabled(dev_type):
        dt = torch.get_autocast_dtype(dev_type)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = None if bias is None else bias.to(dt)
    _check_inputs(hidden, weight, bias, target, accum_dtype)
    impl = check_backend(backend, hidden.device)
    n_classes = weight.shape[0]
    if validate:
        check_target(target, n_classes, ignore_index)
    plan = chunk_plan(hidden, weight, max(1, target.numel()), o, impl, chunk_size, chunk_bytes)
    accum = weight.dtype if accum_dtype is None else accum_dtype
    loss_dtype = torch.promote_types(hidden.dtype, torch.float32)  # float32 for half inputs, as the peers return
    if accum_dtype is not None:
        loss_dtype = torch.promote_types(loss_dtype, accum_dtype)
    with torch.autocast(dev_type, enabled=False):
        return _LinearCrossEntropyFunction.apply(
            hidden, weight, bias, target, o, impl, plan, accum, torch.is_grad_enabled(), loss_dtype
        )
