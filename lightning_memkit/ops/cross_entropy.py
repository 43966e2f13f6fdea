"""Cross-entropy on materialized logits without fp32 copies of them, with z-loss and logit soft-capping.

``F.cross_entropy`` saves a full ``(N, V)`` log-softmax for backward (fp32 under autocast) and then
allocates the gradient. :func:`cross_entropy` saves only the logits (already alive) and one fp32
log-sum-exp per token, recomputes the softmax in backward, and with ``inplace_backward=True``
writes the gradient over the logits in forward, so no ``(N, V)`` tensor is allocated at all.

On CUDA a Triton kernel does the work (one program per token, online softmax over vocabulary
blocks, fp32 math); elsewhere PyTorch does it in row chunks of at most 16 MiB of fp32.

Example::

    >>> import torch
    >>> from lightning_memkit.ops import cross_entropy
    >>> logits = torch.randn(6, 11, requires_grad=True)
    >>> target = torch.tensor([1, 2, -100, 4, 5, 10])
    >>> loss = cross_entropy(logits, target, label_smoothing=0.1, z_loss=1e-4)
    >>> loss.backward()
    >>> logits.grad.shape
    torch.Size([6, 11])
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from lightning_memkit.common.validation import check_bool
from lightning_memkit.measure.storage import may_overlap
from lightning_memkit.ops._cross_entropy_common import (
    CrossEntropyOptions,
    auto_rows,
    check_backend,
    check_target,
    grad_base_scale,
    reduce_loss,
    torch_rows,
    triton_kernels,
)

__all__ = ["cross_entropy"]

_disable_compile = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable


def scale_for_backward(grad_out: torch.Tensor, base: torch.Tensor, reduction: str) -> torch.Tensor:
    go = grad_out.to(torch.float32)
    if reduction == "none":
        return go.reshape(-1)
    return go.reshape(1) * base


def kernel_args(o: CrossEntropyOptions) -> dict:
    return {
        "ignore_index": o.ignore_index,
        "label_smoothing": float(o.label_smoothing),
        "z_loss": float(o.z_loss),
        "softcap": None if o.softcap is None else float(o.softcap),
    }


def _torch_pass(x, target, o, *, loss_rows, lse, grad, grad_scale, lse_known) -> None:
    """Row-chunked PyTorch pass over ``x`` (2-D): fills ``loss_rows``/``lse`` and/or ``grad`` (may be ``x``)."""
    n, v = x.shape
    want_grad = grad is not None
    rows = auto_rows("auto", n, v, x.device, buffers=2 if (o.softcap is not None and want_grad) else 1)
    # fp32 gradient rows can serve as the scratch themselves; otherwise one fp32 chunk buffer
    direct = want_grad and grad.dtype == torch.float32
    buf = None if direct else torch.empty(rows, v, dtype=torch.float32, device=x.device)
    keep = torch.empty(rows, v, dtype=torch.float32, device=x.device) if (o.softcap is not None and want_grad) else None
    per_row = grad_scale is not None and grad_scale.numel() > 1
    for a in range(0, n, rows):
        b = min(a + rows, n)
        z = grad[a:b] if direct else buf[: b - a]
        if z.data_ptr() != x[a:b].data_ptr():
            z.copy_(x[a:b])
        gs = None if not want_grad else (grad_scale[a:b] if per_row else grad_scale)
        loss_c, lse_c = torch_rows(
            z, target[a:b], o, grad_scale=gs, lse=lse[a:b] if lse_known else None,
            keep=None if keep is None else keep[: b - a],
        )
        if loss_c is not None:
            loss_rows[a:b] = loss_c
            lse[a:b] = lse_c
        if want_grad and not direct:
            grad[a:b].copy_(z)


def _pass(x, target, o, backend, *, loss_rows=None, lse=None, grad=None, grad_scale=None, lse_known=False) -> None:
    if backend == "triton":
        triton_kernels().ce_rows(
            x, target, loss=loss_rows, lse=lse, lse_known=lse_known, grad=grad, grad_scale=grad_scale,
            **kernel_args(o),
        )
    else:
        _torch_pass(x, target, o, loss_rows=loss_rows, lse=lse, grad=grad, grad_scale=grad_scale, lse_known=lse_known)


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, o: CrossEntropyOptions, backend: str, inplace_backward: bool, grad_enabled: bool):
        v = logits.shape[-1]
        x = logits.reshape(-1, v)
        if x.stride(-1) != 1:
            x = x.contiguous()
        t = target.reshape(-1).contiguous()
        n = x.shape[0]
        need_grad = grad_enabled and ctx.needs_input_grad[0]
        write = need_grad and inplace_backward
        n_valid, base = grad_base_scale(t, o)
        loss_rows = torch.empty(n, dtype=torch.float32, device=x.device)
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        _pass(x, t, o, backend, loss_rows=loss_rows, lse=lse, grad=x if write else None, grad_scale=base)
        ctx.o, ctx.backend, ctx.inplace, ctx.shape = o, backend, write, logits.shape
        if write:
            # the logits now hold gradients: anything that saved them for its backward must fail loudly
            torch.autograd.graph.increment_version(x)
            ctx.grad_buf = x
        elif need_grad:
            ctx.save_for_backward(x, t, lse, base)
        return reduce_loss(loss_rows, o, n_valid, target.shape, logits.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        o = ctx.o
        if ctx.inplace:
            g = ctx.grad_buf
            if g is None:
                raise RuntimeError(
                    "cross_entropy(inplace_backward=True) can be differentiated once: the gradient was written "
                    "over the logits and has been handed out; use inplace_backward=False to retain the graph"
                )
            ctx.grad_buf = None
            if o.reduction == "none":
                g.mul_(grad_out.reshape(-1, 1))
            else:
                g.mul_(grad_out)
            return g.view(ctx.shape), None, None, None, None, None
        x, t, lse, base = ctx.saved_tensors
        scale = scale_for_backward(grad_out, base, o.reduction)
        grad = torch.empty_like(x)
        _pass(x, t, o, ctx.backend, lse=lse, grad=grad, grad_scale=scale, lse_known=True)
        return grad.view(ctx.shape), None, None, None, None, None


def _rows_overlap(logits: torch.Tensor) -> bool:
    """Whether the ``(N, V)`` rows the forward would write the gradient into share memory (expand, as_strided).

    Mirrors the forward: ``reshape(-1, V)`` (a copy when no view exists) and ``contiguous()`` when the class
    stride is not 1 (copies never overlap); a view with unit class stride overlaps iff a row stride < ``V``.
    """
    v = logits.shape[-1]
    if v == 0 or logits.numel() == 0:
        return False
    try:
        x = logits.view(-1, v)
    except RuntimeError:
        return False
    return x.stride(-1) == 1 and may_overlap(x)


def check_logits_target(logits: torch.Tensor, target: torch.Tensor, logits_name: str = "logits") -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"{logits_name} must be a floating-point tensor, got {type(logits).__name__}"
                        + (f" of dtype {logits.dtype}" if isinstance(logits, torch.Tensor) else ""))
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex() \
            or target.dtype == torch.bool:
        raise TypeError(
            "target must be an integer tensor of class indices (class probabilities are not supported), got "
            + (f"dtype {target.dtype}" if isinstance(target, torch.Tensor) else type(target).__name__)
        )
    if logits.dim() < 1:
        raise ValueError(f"{logits_name} must have a class dimension last, got a 0-d tensor")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal {logits_name} shape without its last (class) "
            f"dimension, {tuple(logits.shape[:-1])}"
        )
    if target.device != logits.device:
        raise ValueError(f"target is on {target.device} but {logits_name} is on {logits.device}")


@_disable_compile
def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    inplace_backward: bool = False,
    validate: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Cross-entropy of ``logits`` (``(..., V)``, classes last) against ``target`` (``(...)``).

    Matches ``F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ...)`` for
    ``ignore_index``, ``label_smoothing`` and ``reduction`` ("mean" averages over non-ignored
    tokens; NaN when all are ignored). Extras: ``z_loss`` adds ``z_loss * logsumexp(z)**2`` per
    non-ignored token (PaLM); ``softcap`` replaces the logits by ``softcap * tanh(logits / softcap)``
    before the softmax (Gemma 2). The loss has the logits' dtype; all math is fp32.

    Args:
        inplace_backward: write the gradient over ``logits`` during forward (saves one ``(N, V)``
            tensor). Safe only when nothing else reads ``logits`` afterwards: their values are
            replaced, and any op that saved them for its backward raises autograd's "modified by an
            inplace operation" error instead of computing a wrong gradient. The graph can then be
            differentiated once. Logits whose rows share memory (``expand``, overlapping ``as_strided``)
            cannot hold a gradient: ``inplace_backward=True`` on them raises ``ValueError`` (nothing is
            computed or written); the default out-of-place path handles them. Default ``False``.
        validate: check that every target is in ``[0, V)`` or ``ignore_index`` and raise
            ``ValueError`` otherwise. Costs one host sync on accelerators; with ``validate=False`` a
            bad target yields a NaN loss (and NaN gradient) for its token, never an out-of-bounds read.
        backend: ``"auto"`` (Triton on CUDA, PyTorch elsewhere), ``"triton"`` (CUDA, or CPU under
            ``TRITON_INTERPRET=1``) or ``"torch"``.

    Example::

        >>> import torch
        >>> logits = torch.randn(2, 3, 7)
        >>> target = torch.randint(0, 7, (2, 3))
        >>> cross_entropy(logits, target, reduction="none").shape
        torch.Size([2, 3])
    """
    o = CrossEntropyOptions(ignore_index, label_smoothing, z_loss, softcap, reduction)
    check_logits_target(logits, target)
    check_bool(inplace_backward, "inplace_backward", owner="cross_entropy")
    check_bool(validate, "validate", owner="cross_entropy")
    if inplace_backward and _rows_overlap(logits):
        raise ValueError(
            f"cross_entropy(inplace_backward=True): logits of shape {tuple(logits.shape)} and strides "
            f"{logits.stride()} overlap themselves (an expand or as_strided view), so the gradient cannot be "
            "written over them; pass inplace_backward=False or logits.contiguous()"
        )
    impl = check_backend(backend, logits.device)
    if validate:
        check_target(target, logits.shape[-1], ignore_index)
    return _CrossEntropyFunction.apply(logits, target, o, impl, inplace_backward, torch.is_grad_enabled())
