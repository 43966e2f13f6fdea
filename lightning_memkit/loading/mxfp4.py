"""Dequantize MXFP4 expert weights chunk by chunk, straight into their destination.

GPT-OSS-style checkpoints store a weight ``X`` as two tensors:

- ``X_blocks``: uint8 ``[*lead, R, G, 16]``; each byte holds two FP4 (E2M1) codes, low nibble first, so
  one row ``r`` has ``G`` blocks of 32 values (``K = 32 * G`` values);
- ``X_scales``: uint8 ``[*lead, R, G]``; one E8M0 exponent per block, bias 127 (value ``2 ** (s - 127)``).

The dequantized weight has the last two dimensions swapped, as GPT-OSS loaders lay it out after their
transpose: ``out[*lead, k, r] = FP4[code(r, k)] * 2 ** (scale(r, k // 32) - 127)``, shape
``[*lead, K, R]``. For experts ``[E, R, G, 16]`` that is ``[E, in, out]`` (``in = K``, ``out = R``): what
``transformers.integrations.mxfp4.convert_moe_packed_tensors`` returns, bit for bit.

Each chunk of rows goes through a 256-entry table of value pairs (one int32-indexed gather per byte of the
chunk, instead of index tensors of the whole weight), is scaled by an exact power of two and is written
into ``out``; the only temporaries are one chunk's.

Example::

    >>> import torch
    >>> from lightning_memkit.loading import dequantize_mxfp4
    >>> blocks = torch.full((2, 3, 1, 16), 0x21, dtype=torch.uint8)   # codes 1 (0.5) then 2 (1.0)
    >>> scales = torch.full((2, 3, 1), 128, dtype=torch.uint8)        # x 2
    >>> w = dequantize_mxfp4(blocks, scales)
    >>> w.shape, w[0, :2, 0].tolist()
    (torch.Size([2, 32, 3]), [1.0, 2.0])
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from lightning_memkit.common.validation import check_int
from lightning_memkit.measure.storage import may_overlap

__all__ = [
    "FP4_VALUES",
    "dequantize_mxfp4",
    "mxfp4_output_shape",
    "check_mxfp4",
    "check_writable",
    "chunk_transient_bytes",
    "default_rows_per_chunk",
]

FP4_VALUES = (+0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK_BYTES = 16  # 32 FP4 values per scale
CHUNK_BYTES = 16 * 2**20  # default temporaries per chunk (fewer, larger ops; small next to a model)


def mxfp4_output_shape(blocks_shape: Sequence[int]) -> tuple[int, ...]:
    """``[*lead, R, G, 16]`` -> ``[*lead, 32 * G, R]``."""
    *lead, rows, groups, _ = blocks_shape
    return (*lead, groups * 2 * BLOCK_BYTES, rows)


def check_mxfp4(
    name: str,
    blocks_shape: Sequence[int],
    blocks_dtype: torch.dtype,
    scales_shape: Sequence[int],
    scales_dtype: torch.dtype,
    target_shape: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """Validate one blocks/scales pair (and its destination); return the dequantized shape.

    Raises ``ValueError`` naming ``name`` for a wrong dtype, rank, block size or shape mismatch.
    """
    blocks_shape, scales_shape = tuple(blocks_shape), tuple(scales_shape)
    if blocks_dtype != torch.uint8:
        raise ValueError(f"{name}_blocks: dtype {blocks_dtype} is not allowed; MXFP4 blocks are torch.uint8")
    if scales_dtype != torch.uint8:
        raise ValueError(f"{name}_scales: dtype {scales_dtype} is not allowed; E8M0 scales are torch.uint8")
    if len(blocks_shape) < 3 or blocks_shape[-1] != BLOCK_BYTES:
        raise ValueError(
            f"{name}_blocks: shape {list(blocks_shape)} is not [..., rows, groups, {BLOCK_BYTES}] "
            f"(at least 3 dimensions, {BLOCK_BYTES} bytes = 32 FP4 values per block)"
        )
    if scales_shape != blocks_shape[:-1]:
        raise ValueError(
            f"{name}_scales: shape {list(scales_shape)} does not match {name}_blocks {list(blocks_shape)}; "
            f"expected {list(blocks_shape[:-1])}"
        )
    out_shape = mxfp4_output_shape(blocks_shape)
    if target_shape is not None and tuple(target_shape) != out_shape:
        raise ValueError(
            f"{name}: target shape {list(target_shape)} does not match {name}_blocks {list(blocks_shape)}, "
            f"which dequantizes to {list(out_shape)} ([..., 32 * groups, rows])"
        )
    return out_shape


def check_writable(name: str, t: torch.Tensor) -> None:
    """``ValueError`` naming ``name`` if ``t`` cannot be written element by element (meta, inference, overlapping)."""
    if t.device.type == "meta":
        raise ValueError(f"{name}: is on the meta device, which holds no data to write")
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(f"{name}: is an inference tensor (made under torch.inference_mode), which cannot be written "
                         "in place outside inference mode; clone it or load inside torch.inference_mode()")
    if may_overlap(t):
        raise ValueError(
            f"{name}: shape {list(t.shape)} with strides {list(t.stride())} overlaps itself (an expand or "
            "as_strided view), so writing it would clobber its own elements; make it a dense tensor first"
        )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where values are built and scaled: ``dtype`` if it holds 2**-127 .. 2**127 exactly, else float32."""
    return dtype if dtype in (torch.bfloat16, torch.float32, torch.float64) else torch.float32


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def chunk_transient_bytes(rows: int, groups: int, dtype: torch.dtype, *, moved: bool = False) -> int:
    """Upper bound of the temporaries of one chunk of ``rows`` packed rows (plus the packed chunk when ``moved``)."""
    packed = rows * groups * BLOCK_BYTES
    size = _itemsize(_compute_dtype(dtype))
    transient = packed * (4 + 2 * size)  # int32 byte index + two values per byte
    transient += rows * groups * (4 + max(4, size)) + 64  # int32 exponents, their factors; scalars
    if moved:
        transient += packed + rows * groups
    return transient


def default_rows_per_chunk(blocks_shape: Sequence[int], dtype: torch.dtype, *, into_out: bool = False) -> int:
    """Packed rows per chunk: temporaries of at most 16 MiB, and at most 1/16 of the output unless ``into_out``.

    A chunk larger than one row group (``R`` rows) spans several leading indices (experts) at once.
    """
    *lead, rows, groups, _ = blocks_shape
    out_bytes = math.prod(lead) * rows * groups * 2 * BLOCK_BYTES * _itemsize(dtype)
    budget = CHUNK_BYTES if into_out else min(CHUNK_BYTES, out_bytes // 16)
    per_row = chunk_transient_bytes(1, groups, dtype, moved=True)
    return max(1, min(rows * max(1, math.prod(lead)), budget // per_row))


def _flat(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    try:
        return t.view(shape)
    except RuntimeError:  # leading dimensions that cannot be merged without a copy
        return None


def _pair_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256, 2]``: the two FP4 values of each byte, low nibble first."""
    values = torch.tensor(FP4_VALUES, dtype=dtype, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack((values[byte & 0x0F], values[byte >> 4]), dim=1)


_WORDS = {1: torch.int16, 2: torch.int32, 4: torch.int64}


class _Tables:
    """Lookup tables for one compute dtype: byte -> value pair (as one word when one fits), exponent -> 2**(s-127)."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.compute = _compute_dtype(dtype)
        self.pairs = _pair_table(self.compute, device)
        word = _WORDS.get(self.pairs.element_size())
        self.words = self.pairs.view(word).view(256) if word is not None else None
        # exact for s <= 254; s = 255 (NaN in E8M0) goes through torch.ldexp like GPT-OSS loaders
        self.factors = torch.pow(2.0, torch.arange(256, dtype=torch.int32, device=device) - 127).to(self.compute)

    def chunk(self, blk: torch.Tensor, sc: torch.Tensor, nan_exponents: bool) -> torch.Tensor:
        """``[n, G, 16]`` bytes and ``[n, G]`` exponents -> ``[n, G * 32]`` values in the compute dtype."""
        n, groups = sc.shape
        idx = blk.reshape(-1).int()
        table = self.words if self.words is not None else self.pairs
        vals = torch.index_select(table, 0, idx)
        del idx
        vals = vals.view(self.compute).view(n, groups, 2 * BLOCK_BYTES)
        exps = sc.reshape(-1).int()
        if nan_exponents:
            torch.ldexp(vals, (exps - 127).view(n, groups, 1), out=vals)
        else:  # power-of-two factor: the product is exact before its one rounding, as with ldexp
            vals.mul_(torch.index_select(self.factors, 0, exps).view(n, groups, 1))
        return vals.view(n, groups * 2 * BLOCK_BYTES)


def dequantize_mxfp4(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    rows_per_chunk: int | None = None,
) -> torch.Tensor:
    """Dequantize ``blocks``/``scales`` (see the module docstring for the layout) into ``[*lead, 32 * G, R]``.

    Args:
        blocks: uint8 ``[*lead, R, G, 16]``.
        scales: uint8 ``[*lead, R, G]``.
        dtype: result dtype; default ``out.dtype`` when ``out`` is given, else ``torch.bfloat16``. Each value
            is the exact product rounded once to ``dtype`` (what ``torch.ldexp`` gives GPT-OSS loaders).
        out: destination (e.g. a model parameter) of shape ``[*lead, 32 * G, R]``, any device and strides
            whose elements do not overlap (``ValueError`` otherwise);
            written chunk by chunk (under ``torch.no_grad``), so no temporary of the whole weight exists.
            Chunks are computed on ``out``'s device (only a chunk of ``blocks`` is moved at a time).
        rows_per_chunk: packed rows per chunk (more than ``R`` covers several experts at once); default
            keeps one chunk's temporaries under 16 MiB, and under 1/16 of the output when ``out`` is not
            given (:func:`default_rows_per_chunk`).

    Returns ``out``, or a new contiguous tensor on ``blocks``' device.
    """
    out_shape = _check_tensors(blocks, scales, out)
    dtype = _result_dtype(dtype, out)
    check_int(rows_per_chunk, "rows_per_chunk", minimum=1, allow_none=True)
    if rows_per_chunk is None:
        rows_per_chunk = default_rows_per_chunk(blocks.shape, dtype, into_out=out is not None)

    device = out.device if out is not None else blocks.device
    if out is None:
        out = torch.empty(out_shape, dtype=dtype, device=device)
    tables = _Tables(dtype, device)
    nan_exponents = scales.numel() > 0 and int(scales.max()) == 255  # a reduction: no temporary of scales' size
    with torch.no_grad():
        if not _dequantize_by_lead(blocks, scales, out, tables, nan_exponents, rows_per_chunk, device):
            _dequantize_by_rows(blocks, scales, out, tables, nan_exponents, rows_per_chunk, device)
    return out


def _check_tensors(blocks, scales, out) -> tuple[int, ...]:
    """``TypeError`` unless the arguments are tensors; the output shape checked by :func:`check_mxfp4`."""
    if not isinstance(blocks, torch.Tensor) or not isinstance(scales, torch.Tensor):
        raise TypeError(f"blocks and scales must be tensors, got {type(blocks).__name__}, {type(scales).__name__}")
    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a tensor or None, got {type(out).__name__}")
    return check_mxfp4("weight", blocks.shape, blocks.dtype, scales.shape, scales.dtype,
                       None if out is None else out.shape)


def _result_dtype(dtype, out: torch.Tensor | None) -> torch.dtype:
    """The floating result dtype (``out``'s when given, which must agree with ``dtype`` and be writable)."""
    if out is not None:
        if dtype is not None and dtype != out.dtype:
            raise ValueError(f"dtype={dtype} differs from out.dtype={out.dtype}; pass one or make them agree")
        dtype = out.dtype
        if out.device.type == "meta":
            raise ValueError("out is on the meta device; allocate it (e.g. torch.empty_like(out, device=...)) first")
        check_writable("out", out)
    dtype = dtype or torch.bfloat16
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} is not allowed; use a floating dtype such as torch.bfloat16")
    return dtype


def _dequantize_by_lead(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, tables: _Tables,
                        nan_exponents: bool, rows_per_chunk: int, device: torch.device) -> bool:
    """Whole row groups (experts) per chunk, when a chunk holds at least ``R`` rows and the leading
    dimensions merge without a copy; ``False`` (nothing written) otherwise."""
    *lead, rows, groups, _ = blocks.shape
    width = groups * 2 * BLOCK_BYTES
    n_lead = math.prod(lead)
    flat = (_flat(blocks, (n_lead, rows, groups, BLOCK_BYTES)), _flat(scales, (n_lead, rows, groups)),
            _flat(out, (n_lead, width, rows)))
    if rows_per_chunk < rows or any(t is None for t in flat):
        return False
    blk_all, sc_all, dst_all = flat
    step = rows_per_chunk // rows
    for p0 in range(0, n_lead, step):
        p1 = min(p0 + step, n_lead)
        blk = blk_all[p0:p1].to(device).reshape((p1 - p0) * rows, groups, BLOCK_BYTES)
        sc = sc_all[p0:p1].to(device).reshape((p1 - p0) * rows, groups)
        vals = tables.chunk(blk, sc, nan_exponents)
        del blk, sc
        dst_all[p0:p1].copy_(vals.view(p1 - p0, rows, width).transpose(1, 2))
        del vals
    return True


def _dequantize_by_rows(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, tables: _Tables,
                        nan_exponents: bool, rows_per_chunk: int, device: torch.device) -> None:
    """``rows_per_chunk`` packed rows of one leading index per chunk."""
    *lead, rows, _, _ = blocks.shape
    for index in itertools.product(*(range(n) for n in lead)):
        blk_all, sc_all, dst_all = blocks[index], scales[index], out[index]  # views: [R, G, 16], [K, R]
        for r0 in range(0, rows, rows_per_chunk):
            r1 = min(r0 + rows_per_chunk, rows)
            vals = tables.chunk(blk_all[r0:r1].to(device), sc_all[r0:r1].to(device), nan_exponents)
            dst_all[:, r0:r1].copy_(vals.t())
            del vals
