"""Triton kernel that copies rows ``out[i] = x[index[i]]`` of a 2-D row-major tensor.

Imported lazily (only on CUDA, or on CPU under ``TRITON_INTERPRET=1``) by
:mod:`lightning_memkit.ops.padded_index_gather`. One program per (output row, column block); the
source row offset is computed in int64 so inputs beyond 2**31 elements are addressed correctly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gather_rows", "MAX_BLOCK"]

MAX_BLOCK = 4096  # widest column block; wider rows use several programs per row


@triton.jit
def _gather_rows_kernel(X, IDX, OUT, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    src = tl.load(IDX + row).to(tl.int64)
    vals = tl.load(X + src * stride_x + cols, mask=mask)
    tl.store(OUT + row * stride_out + cols, vals, mask=mask)


def gather_rows(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``x[index]`` into ``out``: ``x`` is ``(N, D)`` with unit column stride, ``out`` ``(len(index), D)``."""
    n, d = out.shape
    if n == 0 or d == 0:
        return
    block = min(triton.next_power_of_2(d), MAX_BLOCK)
    grid = (n, triton.cdiv(d, block))
    _gather_rows_kernel[grid](x, index, out, d, x.stride(0), out.stride(0), BLOCK=block)
