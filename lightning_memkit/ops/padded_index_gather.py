"""Row gather for token dispatch that keeps nothing of its input and feeds the allocator few block sizes.

``padded_index_gather(input, index)`` returns ``input[index]`` (rows along dim 0) as an ordinary
contiguous tensor of ``len(index)`` rows whose storage is rounded up to a multiple of
``pad_to_multiple`` rows. Downstream code sees the exact shape; the caching allocator sees only
``ceil(len(index) / pad_to_multiple)`` distinct request sizes, so the blocks freed by one microbatch
(whose routed-token count differs from the next) are reused by the next instead of being split or
left cached beside new ones. The padding rows are never read or written.

The autograd Function saves only ``index`` (never ``input``: ``torch.gather`` saves its whole input);
backward scatter-adds the gradient (``scatter_add_`` over an expanded index, one vectorised pass
on every device), which sums the rows of repeated indices (a token sent to several experts). On CUDA the
forward copy is ``torch.index_select`` into the padded buffer; ``backend="triton"`` uses a Triton
kernel instead (:mod:`lightning_memkit.ops.triton.gather`), measured slower on an H100. The result is not a view,
so :func:`~lightning_memkit.memory.release_storage` can free it (padding included) once consumed.

Example::

    >>> import torch
    >>> from lightning_memkit.ops import padded_index_gather
    >>> x = torch.arange(12.0).view(4, 3).requires_grad_()
    >>> y = padded_index_gather(x, torch.tensor([3, 0, 3]), pad_to_multiple=8)
    >>> y.shape, y.untyped_storage().nbytes() // (3 * 4)     # 3 rows seen, 8 rows allocated
    (torch.Size([3, 3]), 8)
    >>> y.sum().backward(); x.grad[:, 0].tolist()
    [1.0, 0.0, 0.0, 2.0]
"""

from __future__ import annotations

import math
import os

import torch
from torch.autograd.function import once_differentiable

from lightning_memkit.common.validation import check_choice, check_int

__all__ = ["padded_index_gather", "padded_rows", "BACKENDS"]

BACKENDS = ("auto", "torch", "triton")
_KERNELS: list = []


def _triton_gather():
    if not _KERNELS:
        try:
            from lightning_memkit.ops.triton.gather import gather_rows
        except ImportError:
            gather_rows = None
        _KERNELS.append(gather_rows)
    return _KERNELS[0]


def padded_rows(n: int, pad_to_multiple: int) -> int:
    """Rows allocated for ``n`` gathered rows: ``n`` rounded up to a multiple of ``pad_to_multiple``."""
    return -(-n // pad_to_multiple) * pad_to_multiple


def _resolve_backend(backend: str, device: torch.device) -> str:
    check_choice(backend, "backend", BACKENDS, owner="padded_index_gather")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "triton":
        if device.type != "cuda" and not interpret:
            raise ValueError(f"padded_index_gather(backend='triton') needs CUDA tensors (got {device}) or "
                             "TRITON_INTERPRET=1; use backend='auto' or 'torch'")
        if _triton_gather() is None:
            raise ValueError("padded_index_gather(backend='triton') needs the triton package, which cannot be imported")
        return "triton"
    # "auto" is torch everywhere: on an H100, index_select into the padded buffer took 23 us against the
    # Triton kernel's 32 us (16384 x 256 fp32, 32768 rows), before the kernel's larger launch cost
    return "torch"


class _PaddedIndexGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input: torch.Tensor, index: torch.Tensor, multiple: int, backend: str) -> torch.Tensor:
        n = index.numel()
        rest = tuple(input.shape[1:])
        buf = input.new_empty((padded_rows(n, multiple), *rest))
        out = input.new_empty(0).set_(buf.untyped_storage(), 0, (n, *rest))  # not a view: owns the storage
        del buf
        if backend == "triton":
            flat = input.reshape(input.shape[0], math.prod(rest))  # explicit width: -1 is ambiguous when empty
            if flat.numel() and flat.stride(-1) != 1:
                flat = flat.contiguous()
            _triton_gather()(flat, index, out.view(n, flat.shape[1]))
        else:
            torch.index_select(input, 0, index, out=out)
        ctx.save_for_backward(index)
        ctx.input_shape = input.shape
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        grad_input = grad.new_zeros(ctx.input_shape)
        if grad.numel() == 0:  # no rows gathered (or empty rows): the gradient is all zeros
            return grad_input, None, None, None
        # scatter_add_ over an expanded index: one vectorised pass on CPU (index_add_ loops over rows) and
        # about half the time of index_add_ on an H100
        width = math.prod(ctx.input_shape[1:])
        flat = grad.reshape(grad.shape[0], width)
        grad_input.view(grad_input.shape[0], width).scatter_add_(0, index.long()[:, None].expand_as(flat), flat)
        return grad_input, None, None, None


def padded_index_gather(
    input: torch.Tensor, index: torch.Tensor, pad_to_multiple: int = 1024, *, backend: str = "auto"
) -> torch.Tensor:
    """``input[index]`` along dim 0, in a storage rounded up to ``pad_to_multiple`` rows; keeps only ``index``.

    Args:
        input: ``(N, *rest)`` tensor (tokens).
        index: 1-D int32/int64 tensor of row numbers in ``[0, N)`` on ``input``'s device; repeats allowed;
            may be empty (a ``(0, *rest)`` result whose backward gives ``input`` an all-zero gradient).
        pad_to_multiple: the allocation is ``ceil(len(index) / pad_to_multiple) * pad_to_multiple`` rows.
        backend: ``"auto"`` (``torch.index_select``, the faster copy on every device measured), ``"torch"`` or
            ``"triton"`` (the Triton kernel: CUDA, or CPU
            under ``TRITON_INTERPRET=1``).

    Returns:
        A contiguous ``(len(index), *rest)`` tensor (not a view) whose storage holds the padded rows.
    """
    if not isinstance(input, torch.Tensor) or not isinstance(index, torch.Tensor):
        raise TypeError(f"padded_index_gather(input, index) takes tensors, got {type(input).__name__} and "
                        f"{type(index).__name__}")
    check_int(pad_to_multiple, "pad_to_multiple", minimum=1, owner="padded_index_gather")
    if input.dim() < 1:
        raise ValueError(f"padded_index_gather(input=...) needs at least one dimension, got shape {tuple(input.shape)}")
    if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"padded_index_gather(index=...) must be a 1-D int32/int64 tensor, got shape "
                         f"{tuple(index.shape)} and dtype {index.dtype}")
    if index.device != input.device:
        raise ValueError(f"padded_index_gather(index=...) is on {index.device}, input on {input.device}; "
                         "they must share a device")
    resolved = _resolve_backend(backend, input.device)
    n_rows = input.shape[0]
    if index.numel() and index.device.type == "cuda":
        # torch.index_select raises a device-side assert for an index outside [0, N) by itself; a check of
        # its own would cost four more kernel launches per call. The Triton kernel reads unchecked: check here.
        if resolved == "triton":
            torch._assert_async(((index >= 0) & (index < n_rows)).all())
    elif index.numel():
        lo, hi = (int(v) for v in torch.aminmax(index))
        if lo < 0 or hi >= n_rows:
            raise ValueError(f"padded_index_gather(index=...) holds {lo if lo < 0 else hi}, outside [0, {n_rows})")
    return _PaddedIndexGather.apply(input, index, pad_to_multiple, resolved)
