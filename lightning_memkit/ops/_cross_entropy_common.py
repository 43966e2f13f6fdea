"""Pieces shared by :func:`cross_entropy` and :func:`linear_cross_entropy`.

Option checks, target checks, backend choice, chunk sizing, and the per-chunk loss and gradient
math in plain PyTorch (the Triton kernel in ``ops/triton/cross_entropy.py`` computes the same
quantities). Per token, with ``z`` the (optionally soft-capped) logits, ``t`` the target,
``eps`` the label smoothing and ``V`` the vocabulary size::

    lse  = logsumexp(z)
    loss = lse - (1 - eps) * z[t] - eps / V * sum(z) + z_loss * lse**2
    dloss/dz = softmax(z) * (1 + 2 * z_loss * lse) - eps / V - (1 - eps) * onehot(t)

Ignored tokens have loss 0 and gradient 0; with ``validate=False`` a target outside ``[0, V)``
gives a NaN loss and NaN gradient for its token instead of an error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from lightning_memkit.common.validation import check_int, check_number

__all__ = [
    "CrossEntropyOptions",
    "check_backend",
    "check_target",
    "auto_rows",
    "chunk_budget",
    "budget_rows",
    "MIN_ROWS",
    "FREE_FRACTION",
    "row_floor",
    "check_chunk_size",
    "grad_base_scale",
    "ClassWeights",
    "class_weighting",
    "check_class_weights",
    "torch_rows",
    "row_masks",
    "row_terms",
    "row_grad",
    "apply_row_grad",
    "RowGrad",
    "triton_kernels",
]

REDUCTIONS = ("mean", "sum", "none")
BACKENDS = ("auto", "torch", "triton")
# "auto" chunk: the most bytes of fp32 logits per chunk, per device type (taller chunks run faster
# GEMMs); linear_cross_entropy further limits a chunk to a quarter of the gradients it produces.
AUTO_CHUNK_BYTES = {"cpu": 16 * 2**20, "cuda": 512 * 2**20}  # GPUs need large matmuls to be efficient
_DEFAULT_CHUNK_BYTES = 16 * 2**20
MIN_AUTO_CHUNK_BYTES = 2**20


@dataclass(frozen=True)
class CrossEntropyOptions:
    """The loss options shared by both ops, checked once at construction."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    reduction: str = "mean"

    def __post_init__(self) -> None:
        check_int(self.ignore_index, "ignore_index")
        check_number(self.label_smoothing, "label_smoothing", minimum=0, maximum=1)
        check_number(self.z_loss, "z_loss", minimum=0)
        check_number(self.softcap, "softcap", minimum=0, min_inclusive=False, allow_none=True)
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")


def check_target(target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """Raise ``ValueError`` if a target is outside ``[0, n_classes)`` and is not ``ignore_index``.

    One host sync on accelerators (``bool(tensor)``); skip it with ``validate=False``. A fake target (``FakeTensor``,
    as in ``memkit estimate``) has no values to check: it passes.
    """
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(target):
        return
    bad = ((target < 0) | (target >= n_classes)) & (target != ignore_index)
    if bool(bad.any()):
        first = target[bad][0].item()
        raise ValueError(
            f"target holds {first}, outside [0, {n_classes}) and not ignore_index={ignore_index}; "
            "targets must be class indices in [0, V) or ignore_index"
        )


def check_backend(backend: str, device: torch.device) -> str:
    """Resolve ``backend`` to ``"torch"`` or ``"triton"`` (``"auto"``: Triton on CUDA when importable)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "torch":
        return "torch"
    if backend == "triton":
        if device.type != "cuda" and not interpret:
            raise ValueError(
                f"backend='triton' needs CUDA tensors (got device {device}) or TRITON_INTERPRET=1 "
                "(the Triton interpreter); use backend='auto' or 'torch'"
            )
        if triton_kernels() is None:
            raise ValueError("backend='triton' needs the triton package, which cannot be imported here")
        return "triton"
    if device.type == "cuda" and triton_kernels() is not None:
        return "triton"
    return "torch"


_KERNELS: list = []  # cached import of lightning_memkit.ops.triton.cross_entropy (or None)


def triton_kernels():
    """The Triton kernel module, imported on first use; ``None`` when triton is missing."""
    if not _KERNELS:
        try:
            from lightning_memkit.ops.triton import cross_entropy as mod
        except ImportError:
            mod = None
        _KERNELS.append(mod)
    return _KERNELS[0]


def check_chunk_size(chunk_size) -> None:
    check_int(chunk_size, "chunk_size", minimum=1, also=("auto",))


def auto_rows(
    chunk_size, n_rows: int, n_classes: int, device: torch.device, buffers: int = 1, budget: int | None = None
) -> int:
    """Rows per chunk of :func:`cross_entropy`: ``chunk_size`` if an int; for ``"auto"``, rows of fp32 logits
    filling ``min(cap, max(1 MiB, budget))`` bytes, with ``cap`` from :data:`AUTO_CHUNK_BYTES` (16 MiB on CPU).

    ``buffers`` is how many ``(rows, V)`` fp32 buffers a chunk needs (2 with softcap on the PyTorch
    path); "auto" divides its bytes by it. Rows >= 32 are rounded down to a multiple of 16. The
    result is clamped to ``[1, n_rows]``.
    """
    if chunk_size == "auto":
        nbytes = AUTO_CHUNK_BYTES.get(device.type, _DEFAULT_CHUNK_BYTES)
        if budget is not None:
            nbytes = min(nbytes, max(MIN_AUTO_CHUNK_BYTES, budget))
        return budget_rows(nbytes // max(1, buffers), 4 * max(1, n_classes), n_rows)
    return max(1, min(int(chunk_size), n_rows))


# linear_cross_entropy's "auto" chunk: its working buffers may take this fraction of the gradients dW + dx that
# the op produces anyway, and no more than FREE_FRACTION of the device's free memory (measured choices, see "The
# chunk rule" in docs/cross_entropy.md: 1/5 keeps the chunk under a quarter of the second copy of dW + dx that
# torch's chunked F.linear_cross_entropy allocates; 1/8 keeps reduction="none" at or under torch's chunked overhead
# with GEMMs as tall as its own: 64 rows at N=4096 H=512 V=32000 fp32, where 48-row GEMMs took 1.27x the time)
GRADIENT_FRACTION = {"mean": 1 / 5, "sum": 1 / 5, "none": 1 / 8}
FREE_FRACTION = 1 / 4
# ... and with "mean"/"sum" at least this many rows where their logits cost at most dW + dx (and FREE_FRACTION of
# the free memory holds them): shorter chunks run slower GEMMs (N=4096 H=512 V=32000 fp32 on 2 AVX2 cores: 1.17x
# CCE's time at 192 rows, 1.04x at 256, 0.89x at 560); a narrow head (fp32: H below about 448) stays at the budget
MIN_ROWS = 448


def chunk_budget(gradient_bytes: int, reduction: str, free_bytes: int | None) -> int:
    """Bytes the chunk buffers of :func:`linear_cross_entropy` may use under ``chunk_size="auto"``.

    ``GRADIENT_FRACTION[reduction] * gradient_bytes`` (the bytes of ``dW + dx``), at most
    ``FREE_FRACTION * free_bytes`` when the free memory is known, and at least 1 MiB.

    Example::

        >>> chunk_budget(300 * 2**20, "mean", free_bytes=None) // 2**20  # a fifth of dW + dx
        60
        >>> chunk_budget(300 * 2**20, "mean", free_bytes=80 * 2**20) // 2**20  # a quarter of what is free
        20
    """
    nbytes = GRADIENT_FRACTION[reduction] * gradient_bytes
    if free_bytes is not None:
        nbytes = min(nbytes, FREE_FRACTION * free_bytes)
    return int(max(MIN_AUTO_CHUNK_BYTES, nbytes))


def row_floor(reduction: str, logit_row_bytes: int, row_bytes: int, gradient_bytes: int, free_bytes: int | None) -> int:
    """The fewest rows of an ``"auto"`` chunk of :func:`linear_cross_entropy`: :data:`MIN_ROWS` with ``"mean"``/
    ``"sum"`` where that many rows of logits (``logit_row_bytes`` each) cost at most ``gradient_bytes`` (``dW + dx``),
    and no more rows (``row_bytes`` each, all of a row's buffers) than ``FREE_FRACTION * free_bytes`` holds; else 0.

    Example::

        >>> row_floor("mean", 4 * 32000, 4 * 32000, (32000 + 4096) * 512 * 4, None)  # N=4096 H=512 V=32000 fp32
        448
        >>> row_floor("mean", 4 * 16384, 4 * 16384, (16384 + 2048) * 256 * 4, None)  # H=256: 448 rows > dW + dx
        0
    """
    if reduction == "none" or MIN_ROWS * logit_row_bytes > gradient_bytes:
        return 0
    if free_bytes is None:
        return MIN_ROWS
    return min(MIN_ROWS, int(FREE_FRACTION * free_bytes) // max(1, row_bytes))


def budget_rows(nbytes: int, row_bytes: int, n_rows: int) -> int:
    """How many rows of ``row_bytes`` fit ``nbytes``: rounded down to a multiple of 16 from 32 rows up, and
    clamped to ``[1, n_rows]``.

    Example::

        >>> budget_rows(100 * 2**20, 4 * 128256, n_rows=4096)
        192
    """
    rows = max(1, nbytes // max(1, row_bytes))
    if rows >= 32:
        rows -= rows % 16
    return max(1, min(rows, n_rows))


def grad_base_scale(target: torch.Tensor, o: CrossEntropyOptions) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(n_valid, base)``: the count of non-ignored targets (fp32, on device, ``None`` unless mean)
    and the per-token gradient factor of the reduction (a 1-element fp32 tensor): ``1/n_valid`` for
    mean, 1 for sum and none. No host sync.
    """
    if o.reduction == "mean":
        n_valid = (target != o.ignore_index).sum().to(torch.float32)
        return n_valid, (1.0 / n_valid).reshape(1)
    return None, torch.ones(1, dtype=torch.float32, device=target.device)


@dataclass(frozen=True)
class ClassWeights:
    """Per-class weights as the row math uses them (all fp32, on the target's device, no host sync).

    ``weight``: ``(V,)``; ``total``: ``(1,)`` ``weight.sum()`` (label smoothing's term); ``z_scale``: ``(1,)``
    factor of the z-loss coefficient, or ``None`` (1). With ``reduction="mean"`` the weighted loss divides by the
    summed weight of the kept targets (torch's ``weight=``) and the z-loss by their count (Liger-Kernel's
    ``ce_weight``): the z-loss coefficient is scaled by ``weight_sum / count`` so one division serves both.
    """

    weight: torch.Tensor
    total: torch.Tensor
    z_scale: torch.Tensor | None


def check_class_weights(class_weights, n_classes: int, device: torch.device) -> None:
    """Raise unless ``class_weights`` is ``None`` or a floating ``(n_classes,)`` tensor on ``device``."""
    if class_weights is None:
        return
    if not isinstance(class_weights, torch.Tensor) or not class_weights.is_floating_point():
        raise TypeError(f"class_weights must be a floating-point tensor of shape ({n_classes},) or None, got "
                        f"{getattr(class_weights, 'dtype', type(class_weights).__name__)}")
    if tuple(class_weights.shape) != (n_classes,):
        raise ValueError(f"class_weights must have shape ({n_classes},) (one weight per class), got "
                         f"{tuple(class_weights.shape)}")
    if class_weights.device != device:
        raise ValueError(f"class_weights is on {class_weights.device} but the inputs are on {device}")


def class_weighting(
    class_weights: torch.Tensor | None, target: torch.Tensor, o: CrossEntropyOptions
) -> tuple[ClassWeights | None, torch.Tensor | None, torch.Tensor]:
    """``(weights, denominator, base)``: :func:`grad_base_scale` with per-class weights (``None``: unweighted).

    With weights and ``reduction="mean"`` the denominator is the kept targets' summed weight, as torch's
    ``F.cross_entropy(weight=...)``. No host sync.
    """
    if class_weights is None:
        return (None, *grad_base_scale(target, o))
    w = class_weights.detach().to(torch.float32)
    total = w.sum().reshape(1)
    if o.reduction != "mean":
        return (ClassWeights(w, total, None), *grad_base_scale(target, o))
    valid = target != o.ignore_index
    kept = torch.where(valid, target, 0)
    denom = (w[kept] * valid).sum()
    count = valid.sum().to(torch.float32)
    return ClassWeights(w, total, (denom / count).reshape(1)), denom, (1.0 / denom).reshape(1)


def row_masks(target: torch.Tensor, n_classes: int, ignore_index: int):
    valid = target != ignore_index
    ok = valid & (target >= 0) & (target < n_classes)
    bad = valid & ~ok
    safe = torch.where(ok, target, 0)
    return ok, bad, safe


def row_terms(target: torch.Tensor, o: CrossEntropyOptions, weights: ClassWeights | None, n_classes: int):
    """``(ok, bad, safe, zl, w_t)`` of rows with ``target``: the masks of :func:`row_masks`, the z-loss coefficient
    (scaled for class weights) and the targets' class weights (None without)."""
    ok, bad, safe = row_masks(target, n_classes, o.ignore_index)
    zl = o.z_loss if weights is None or weights.z_scale is None or not o.z_loss else o.z_loss * weights.z_scale
    w_t = None if weights is None else torch.where(ok, weights.weight[safe], 0.0)
    return ok, bad, safe, zl, w_t


def _tanh_and_cap(z: torch.Tensor, cap: float, keep: torch.Tensor | None) -> None:
    z.div_(cap).tanh_()
    if keep is not None:
        keep.copy_(z)
    z.mul_(cap)


def torch_rows(
    z: torch.Tensor,
    target: torch.Tensor,
    o: CrossEntropyOptions,
    *,
    grad_scale: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    weights: ClassWeights | None = None,
    token_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Loss and log-sum-exp of a chunk of rows, and optionally their gradient, in place.

    Args:
        z: ``(r, V)`` float32 raw logits that this function overwrites.
        target: ``(r,)`` integer targets.
        grad_scale: ``(r,)`` or ``(1,)`` float32 factor per row; when given, ``z`` holds
            ``dloss/dlogits * grad_scale`` on return (0 for ignored rows, NaN for bad ones).
        lse: the rows' log-sum-exp when already known (backward); the loss is then not computed.
        keep: ``(r, V)`` float32 scratch, required when ``softcap`` is set and a gradient is wanted.
        weights: per-class weights (:class:`ClassWeights`); the row math is then, with ``w_t`` the target's
            weight and ``W`` their sum: ``(1 - eps) * w_t * (lse - z_t) + eps / V * (W * lse - w . z) + zl * lse**2``.
        token_scale: ``(r,)`` float32 output for token scaling (Liger-Kernel's ``use_token_scaling``): receives each
            row's predicted probability of its target, ``exp(z_t - lse)`` (detached; 0 where ignored), which then
            scales the row's loss and gradient. Only with ``lse`` unknown (backward folds it into ``grad_scale``).

    Returns:
        ``(loss, lse)``: float32 ``(r,)`` each; ``loss`` is ``None`` when ``lse`` was given.
    """
    n_classes = z.shape[1]
    eps = float(o.label_smoothing)
    cap = o.softcap
    ok, bad, safe, zl, w_t = row_terms(target, o, weights, n_classes)
    want_grad = grad_scale is not None
    if cap is not None:
        if want_grad and keep is None:
            raise ValueError("torch_rows: softcap with a gradient needs the keep buffer")
        _tanh_and_cap(z, cap, keep if want_grad else None)
    loss = None
    if lse is None:
        zt = z.gather(1, safe.unsqueeze(1)).squeeze(1)
        zsum = None
        if eps > 0.0:
            zsum = z.sum(1) if weights is None else z @ weights.weight
        m = z.amax(1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        z.sub_(m).exp_()
        s = z.sum(1, keepdim=True)
        lse = (m + s.log()).squeeze(1)
        loss = _row_loss(lse, zt, zsum, eps, n_classes, zl, w_t, weights)
        fill = torch.where(bad, float("nan"), 0.0).to(loss.dtype)
        loss = torch.where(ok, loss, fill)
        inv_s = s.reciprocal_().squeeze(1)  # z holds exp(z - m); p = z / s
        if token_scale is not None:
            grad_scale = _scale_tokens(token_scale, zt, lse, ok, bad, grad_scale)
            loss = loss * token_scale
    else:
        if token_scale is not None:
            raise ValueError("torch_rows: token_scale is computed with the log-sum-exp; backward passes it in "
                             "grad_scale")
        z.sub_(lse.unsqueeze(1))
        z.exp_()  # z holds p
        inv_s = None
    if want_grad:
        c = row_grad(lse, grad_scale, ok, bad, eps, zl, w_t, weights, n_classes)
        if inv_s is not None:  # z holds exp(z - m): p = z / s
            c = c._replace(coef=c.coef * inv_s)
        apply_row_grad(z, c, safe, None if weights is None else weights.weight)
        if cap is not None:
            keep.square_().neg_().add_(1.0)  # d(cap * tanh(x / cap))/dx = 1 - tanh^2
            z.mul_(keep)
    return loss, lse


def _scale_tokens(out, zt, lse, ok, bad, grad_scale):
    """Fill ``out`` with the rows' target probabilities ``exp(z_t - lse)`` (0 where ignored, NaN for bad targets);
    return ``grad_scale`` times them (``None`` stays ``None``)."""
    p = torch.where(ok, torch.exp(zt - lse), 0.0)
    out.copy_(torch.where(bad, float("nan"), p))
    return None if grad_scale is None else grad_scale.to(torch.float32) * out


def _row_loss(lse, zt, zsum, eps, n_classes, zl, w_t, weights):
    """Per-row loss from the log-sum-exp, the target logit and (with smoothing) the (weighted) logit sum."""
    if weights is None:
        loss = lse - (1.0 - eps) * zt
        if zsum is not None:
            loss = loss - (eps / n_classes) * zsum
    else:
        loss = (1.0 - eps) * w_t * (lse - zt)
        if zsum is not None:
            loss = loss + (eps / n_classes) * (weights.total * lse - zsum)
    if _has_z(zl):
        loss = loss + zl * lse * lse
    return loss


def _has_z(zl) -> bool:
    """Whether a z-loss coefficient (a float or a 1-element tensor) is in use."""
    return isinstance(zl, torch.Tensor) or bool(zl)


class RowGrad(NamedTuple):
    """Per-row coefficients of the loss's gradient with respect to the logits: ``coef * p - smooth * w +
    target * onehot`` (``w``: the class weights, or 1; ``smooth`` None without label smoothing)."""

    coef: torch.Tensor
    target: torch.Tensor
    smooth: torch.Tensor | None


def row_grad(lse, grad_scale, ok, bad, eps, zl, w_t, weights, n_classes: int) -> RowGrad:
    """The :class:`RowGrad` of rows with log-sum-exp ``lse`` scaled by ``grad_scale`` (0 where ignored, NaN for bad
    targets; ``w_t``: the targets' class weights, or None)."""
    gs = torch.where(ok, grad_scale.to(torch.float32), 0.0)
    gs = torch.where(bad, float("nan"), gs)
    if weights is None:
        coef = gs * (1.0 + 2.0 * zl * lse) if _has_z(zl) else gs
        target_coef = gs * -(1.0 - eps)
    else:
        p_coef = (1.0 - eps) * w_t + (eps / n_classes) * weights.total
        if _has_z(zl):
            p_coef = p_coef + 2.0 * zl * lse
        coef = gs * p_coef
        target_coef = gs * -(1.0 - eps) * w_t
    return RowGrad(coef, target_coef, gs * (eps / n_classes) if eps > 0.0 else None)


def apply_row_grad(p: torch.Tensor, c: RowGrad, index: torch.Tensor, class_weight: torch.Tensor | None) -> None:
    """Overwrite ``p`` (probabilities of some rows and columns) with the gradient of :func:`row_grad`'s ``c``:
    ``c.target`` lands at column ``index`` of each row (give 0 there for targets outside the columns);
    ``class_weight``: the columns' class weights, or None."""
    p.mul_(c.coef.unsqueeze(1))
    if c.smooth is not None and class_weight is None:
        p.sub_(c.smooth.unsqueeze(1))
    elif c.smooth is not None:
        p.addr_(c.smooth, class_weight, alpha=-1.0)
    p.scatter_add_(1, index.unsqueeze(1), c.target.unsqueeze(1))


def reduce_loss(loss_rows: torch.Tensor, o: CrossEntropyOptions, n_valid: torch.Tensor | None, shape, dtype):
    """Apply the reduction to fp32 per-token losses and cast to the output dtype."""
    if o.reduction == "mean":
        return (loss_rows.sum() / n_valid).to(dtype)
    if o.reduction == "sum":
        return loss_rows.sum().to(dtype)
    return loss_rows.reshape(shape).to(dtype)
