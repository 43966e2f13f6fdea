"""Triton kernel for cross-entropy over rows of logits: one program per row, online softmax over
vocabulary blocks, fp32 math whatever the logits dtype.

Imported lazily (only on CUDA, or on CPU under ``TRITON_INTERPRET=1``) by
:mod:`lightning_memkit.ops.cross_entropy` and :mod:`lightning_memkit.ops.linear_cross_entropy`.
The kernel computes per row the loss and the log-sum-exp, and optionally the gradient of the loss
with respect to the raw logits times a per-row factor; the gradient may be written over the logits
themselves (each block is read before it is written). The true-class term ``p_t - (1 - eps)`` is
formed in fp32 before the single rounding to the output dtype.

With class weights ``w`` (``W = sum(w)``), z-loss coefficient ``zl = z_loss * z_scale`` and ``p = exp(z - lse)``:
``loss = (1-eps) w_t (lse - z_t) + eps/V (W lse - sum_c w_c z_c) + zl lse^2`` and
``dloss/dz_c = p_c ((1-eps) w_t + eps/V W + 2 zl lse) - eps/V w_c - (1-eps) w_t [c == t]``
(without weights ``w = 1``, ``W = V``: the unweighted formulas, computed by their own code path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["ce_rows", "MAX_BLOCK"]

MAX_BLOCK = 16384  # widest vocabulary block; larger vocabularies loop over blocks


@triton.jit
def _tanh(x):
    # libdevice.tanh is not available under TRITON_INTERPRET, so tanh is built from exp:
    # an odd polynomial near 0 (no cancellation), (1 - e) / (1 + e) with e = exp(-2|x|) elsewhere.
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    a2 = a * a
    small = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * -0.05396825396825397)))
    r = tl.where(a < 0.0625, small, big)
    return tl.where(x < 0.0, -r, r)


@triton.jit
def _zero_ignored_row(
    G,
    stride_g,
    LOSS,
    LSE,
    TSCALE,
    row,
    n_cols,
    HAS_LSE: tl.constexpr,
    WRITE_LOSS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    TOKEN_SCALING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Write an ignored row's outputs: loss, log-sum-exp, token scale and gradient all 0."""
    if WRITE_LOSS:
        tl.store(LOSS + row, 0.0)
    if not HAS_LSE:
        tl.store(LSE + row, 0.0)
    if TOKEN_SCALING:
        tl.store(TSCALE + row, 0.0)
    if WRITE_GRAD:
        G += row * stride_g
        for start in range(0, n_cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            zero = tl.zeros([BLOCK], dtype=tl.float32)
            tl.store(G + offs, zero.to(G.dtype.element_ty), mask=offs < n_cols)


@triton.jit
def _row_lse(
    X,
    WEIGHT,
    n_cols,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Online softmax over the row's blocks: its log-sum-exp and the smoothing sum (weighted: ``sum_c w_c z_c``)."""
    m = float("-inf")
    d = 0.0
    zsum = 0.0
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_cols
        z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = softcap * _tanh(z / softcap)
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                w = tl.load(WEIGHT + offs, mask=mask, other=0.0).to(tl.float32)
                zsum += tl.sum(tl.where(mask, w * z, 0.0), axis=0)  # sum_c w_c z_c
            else:
                zsum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    return m + tl.log(d), zsum


@triton.jit
def _store_grad_row(
    X,
    G,
    WEIGHT,
    t,
    lse,
    scale,
    coef,
    wt_true,
    smooth,
    n_cols,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Write the row's scaled gradient block by block (``p_c coef - smooth w_c - wt_true [c == t]``, softcapped)."""
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            th = _tanh(x / softcap)
            z = softcap * th
        else:
            z = x
        g = tl.exp(z - lse) * coef
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                w = tl.load(WEIGHT + offs, mask=mask, other=0.0).to(tl.float32)
                g = g - smooth * w
            else:
                g = g - smooth
        g = tl.where(offs == t, g - wt_true, g)
        if HAS_SOFTCAP:
            g = g * (1.0 - th * th)
        g = g * scale
        tl.store(G + offs, g.to(G.dtype.element_ty), mask=mask)


@triton.jit
def _ce_rows_kernel(
    X,
    stride_x,
    G,
    stride_g,
    T,
    LOSS,
    LSE,
    SCALE,
    stride_scale,
    WEIGHT,
    WSUM,
    ZSCALE,
    TSCALE,
    n_cols,
    ignore_index,
    eps,
    z_loss,
    softcap,
    HAS_LSE: tl.constexpr,
    WRITE_LOSS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_ZSCALE: tl.constexpr,
    TOKEN_SCALING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x
    t = tl.load(T + row).to(tl.int64)
    valid = t != ignore_index
    bad = valid & ((t < 0) | (t >= n_cols))
    ok = valid & (t >= 0) & (t < n_cols)

    if t == ignore_index:
        # ignored token: loss 0, gradient 0, nothing else to read
        _zero_ignored_row(G, stride_g, LOSS, LSE, TSCALE, row, n_cols, HAS_LSE, WRITE_LOSS, WRITE_GRAD, TOKEN_SCALING,
                          BLOCK)
        return

    zl = z_loss
    if HAS_ZSCALE:
        zl = z_loss * tl.load(ZSCALE).to(tl.float32)
    if HAS_WEIGHT:
        wt = tl.load(WEIGHT + tl.where(ok, t, 0)).to(tl.float32)
        wsum = tl.load(WSUM).to(tl.float32)

    if HAS_LSE:
        lse = tl.load(LSE + row)
    else:
        lse, zsum = _row_lse(X, WEIGHT, n_cols, softcap, HAS_SOFTCAP, HAS_SMOOTHING, HAS_WEIGHT, BLOCK)
        tl.store(LSE + row, lse)
        zt = tl.load(X + tl.where(ok, t, 0)).to(tl.float32)
        if HAS_SOFTCAP:
            zt = softcap * _tanh(zt / softcap)
        if TOKEN_SCALING:  # the target's predicted probability (detached) scales the row's loss and gradient
            tscale = tl.where(bad, float("nan"), tl.exp(zt - lse))
            tl.store(TSCALE + row, tscale)
        if WRITE_LOSS:
            if HAS_WEIGHT:
                loss = (1.0 - eps) * wt * (lse - zt)
                if HAS_SMOOTHING:
                    loss += eps / n_cols * (wsum * lse - zsum)
            else:
                loss = lse - (1.0 - eps) * zt
                if HAS_SMOOTHING:
                    loss -= eps * zsum / n_cols
            loss += zl * lse * lse
            loss = tl.where(bad, float("nan"), loss)
            if TOKEN_SCALING:
                loss = loss * tscale
            tl.store(LOSS + row, loss)

    if WRITE_GRAD:
        G += row * stride_g
        scale = tl.load(SCALE + row * stride_scale).to(tl.float32)
        scale = tl.where(bad, float("nan"), scale)
        if TOKEN_SCALING:
            scale = scale * tscale
        smooth = eps / n_cols
        if HAS_WEIGHT:
            wt_true = (1.0 - eps) * wt
            coef = wt_true + 2.0 * zl * lse
            if HAS_SMOOTHING:
                coef += smooth * wsum
        else:
            wt_true = 1.0 - eps
            coef = 1.0 + 2.0 * zl * lse
        _store_grad_row(X, G, WEIGHT, t, lse, scale, coef, wt_true, smooth, n_cols, softcap, HAS_SOFTCAP, HAS_SMOOTHING,
                        HAS_WEIGHT, BLOCK)


def _launch_shape(n_cols: int) -> tuple[int, int]:
    block = min(MAX_BLOCK, triton.next_power_of_2(max(1, n_cols)))
    num_warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, num_warps


def ce_rows(
    x: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    loss: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    lse_known: bool = False,
    grad: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    weight_sum: torch.Tensor | None = None,
    z_scale: torch.Tensor | None = None,
    token_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the kernel over the rows of ``x`` (``(r, V)``, unit stride along V); returns ``lse``.

    ``loss`` (fp32 ``(r,)``) receives per-row losses when given. ``lse`` (fp32 ``(r,)``) is read when
    ``lse_known`` else written. ``grad`` (``(r, V)``, may be ``x`` itself) receives
    ``dloss/dx * grad_scale`` when given; ``grad_scale`` is fp32 with 1 element or ``r`` elements.
    ``weight`` (fp32 ``(V,)``) weighs the classes as ``F.cross_entropy(weight=...)`` does per row (no
    normalisation), and then needs ``weight_sum`` (1 element holding ``weight.sum()``). ``z_scale`` (1 element)
    multiplies ``z_loss``; tensors, so that nothing waits for the host. ``token_scale`` (fp32 ``(r,)``, with
    ``lse`` unknown) receives each row's target probability ``exp(z_t - lse)``, which then scales its loss and
    gradient (token scaling; 0 where ignored). All on ``x``'s device.
    """
    n_rows, n_cols = x.shape
    if x.stride(1) != 1 or (grad is not None and grad.stride(1) != 1):
        raise ValueError("ce_rows needs unit stride along the vocabulary dimension")
    if weight is not None:
        weight, weight_sum = _float32_weights(weight, weight_sum, n_cols, x.device)
    if z_scale is not None:
        z_scale = _float32_z_scale(z_scale, x.device)
    _check_scales(grad, grad_scale, token_scale, lse_known, n_rows, x.device)
    if lse is None:
        if lse_known:
            raise ValueError("ce_rows: lse_known=True needs lse")
        lse = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return lse
    _launch(x, target, lse, loss, grad, grad_scale, weight, weight_sum, z_scale, token_scale, ignore_index=ignore_index,
            label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, lse_known=lse_known)
    return lse


def _float32_weights(weight: torch.Tensor, weight_sum: torch.Tensor | None, n_cols: int, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the class weights and their sum against the logits' classes and device; return both as float32."""
    if weight_sum is None:
        raise ValueError("ce_rows: weight needs weight_sum (a 1-element tensor holding weight.sum())")
    if weight.numel() != n_cols or weight_sum.numel() != 1:
        raise ValueError(f"ce_rows: weight needs {n_cols} elements and weight_sum 1, got {weight.numel()} and "
                         f"{weight_sum.numel()}")
    if weight.device != device or weight_sum.device != device:
        raise ValueError("ce_rows: weight and weight_sum must be on the logits' device")
    return weight.to(torch.float32).contiguous(), weight_sum.to(torch.float32).contiguous()


def _float32_z_scale(z_scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Check that ``z_scale`` is one element on the logits' device; return it contiguous in float32."""
    if z_scale.numel() != 1 or z_scale.device != device:
        raise ValueError("ce_rows: z_scale must be a 1-element tensor on the logits' device")
    return z_scale.to(torch.float32).contiguous()


def _check_scales(grad: torch.Tensor | None, grad_scale: torch.Tensor | None, token_scale: torch.Tensor | None,
                  lse_known: bool, n_rows: int, device: torch.device) -> None:
    """Check that a gradient comes with ``grad_scale``, and ``token_scale`` (float32, one per row) with lse unknown."""
    if grad is not None and grad_scale is None:  # checked before any early return: bad input fails on empty too
        raise ValueError("ce_rows: a gradient needs grad_scale")
    if token_scale is not None and (lse_known or token_scale.numel() != n_rows or token_scale.device != device
                                    or token_scale.dtype != torch.float32):
        raise ValueError("ce_rows: token_scale must be a float32 tensor of one element per row on the logits' "
                         "device, with lse unknown")


def _launch(x, target, lse, loss, grad, grad_scale, weight, weight_sum, z_scale, token_scale, *, ignore_index,
            label_smoothing, z_loss, softcap, lse_known) -> None:
    """Launch the kernel over the rows of ``x``; ``lse`` stands in for the tensors not given, which it leaves alone."""
    n_rows, n_cols = x.shape
    if grad is None:
        g, stride_g, scale, stride_scale = x, 0, lse, 0
    else:
        scale = grad_scale.to(torch.float32).contiguous()
        g, stride_g, stride_scale = grad, grad.stride(0), 0 if scale.numel() == 1 else 1
    block, num_warps = _launch_shape(n_cols)
    _ce_rows_kernel[(n_rows,)](
        x,
        x.stride(0),
        g,
        stride_g,
        target,
        loss if loss is not None else lse,
        lse,
        scale,
        stride_scale,
        weight if weight is not None else lse,
        weight_sum if weight is not None else lse,
        z_scale if z_scale is not None else lse,
        token_scale if token_scale is not None else lse,
        n_cols,
        ignore_index,
        float(label_smoothing),
        float(z_loss),
        float(softcap) if softcap is not None else 1.0,
        HAS_LSE=lse_known,
        WRITE_LOSS=loss is not None,
        WRITE_GRAD=grad is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SMOOTHING=label_smoothing > 0.0,
        HAS_WEIGHT=weight is not None,
        HAS_ZSCALE=z_scale is not None,
        TOKEN_SCALING=token_scale is not None,
        BLOCK=block,
        num_warps=num_warps,
    )
