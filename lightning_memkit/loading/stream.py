"""Dequantize an MXFP4 state dict one weight at a time, freeing each packed pair before the next.

Example::

    >>> import torch
    >>> from lightning_memkit.loading import stream_dequantize
    >>> sd = {"experts.w_blocks": torch.zeros(2, 4, 1, 16, dtype=torch.uint8),
    ...       "experts.w_scales": torch.full((2, 4, 1), 127, dtype=torch.uint8),
    ...       "experts.bias": torch.zeros(2, 4)}
    >>> [(name, tuple(t.shape)) for name, t in stream_dequantize(sd)]
    [('experts.w', (2, 32, 4)), ('experts.bias', (2, 4))]
    >>> sd
    {}
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, MutableMapping

import torch

from lightning_memkit.common.validation import check_int
from lightning_memkit.loading.mxfp4 import check_mxfp4, dequantize_mxfp4
from lightning_memkit.measure.device import resolve_device

__all__ = ["stream_dequantize", "split_mxfp4_name"]

log = logging.getLogger("lightning_memkit")

_SUFFIXES = ("_blocks", "_scales")


def split_mxfp4_name(name: str) -> tuple[str, str | None]:
    """``"a.w_blocks"`` -> ``("a.w", "_blocks")``; names without an MXFP4 suffix -> ``(name, None)``."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], suffix
    return name, None


def _plan(state_dict: MutableMapping[str, torch.Tensor]) -> list[tuple[str, bool]]:
    """``(name, is_pair)`` in the dict's order; validates every pair before anything is popped."""
    plan: list[tuple[str, bool]] = []
    seen: set[str] = set()
    for key in list(state_dict):
        if not isinstance(state_dict[key], torch.Tensor):
            raise TypeError(f"state_dict[{key!r}] must be a tensor, got {type(state_dict[key]).__name__}")
        base, suffix = split_mxfp4_name(key)
        if suffix is None:
            plan.append((key, False))
            continue
        if base in seen:
            continue
        seen.add(base)
        blocks, scales = state_dict.get(base + "_blocks"), state_dict.get(base + "_scales")
        if blocks is None or scales is None:
            present, absent = (base + "_blocks", base + "_scales") if scales is None else (
                base + "_scales", base + "_blocks")
            raise ValueError(f"{present} has no matching {absent}; MXFP4 weights need both")
        check_mxfp4(base, blocks.shape, blocks.dtype, scales.shape, scales.dtype)
        plan.append((base, True))
    return plan


def stream_dequantize(
    state_dict: MutableMapping[str, torch.Tensor],
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    rows_per_chunk: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Consume ``state_dict`` entry by entry: yield ``(name, tensor)`` and drop the source from the dict.

    ``X_blocks`` + ``X_scales`` become one ``(X, dequantized)`` (layout of :func:`dequantize_mxfp4`); other
    entries are yielded as they are (moved to ``device`` if given). Each packed pair is popped and released
    before its weight is yielded, so with a consumer that copies each weight away and drops it
    (``for name, t in stream_dequantize(sd): params[name].copy_(t)``) the peak is the remaining packed dict
    plus one dequantized weight, instead of every packed and every dequantized tensor at once. Collecting
    the results (``dict(stream_dequantize(sd))``) still frees the packed tensors as it goes.

    Every argument and the whole dict (tensors, pairs complete, dtypes, shapes) are validated when this is
    called, before any entry is removed (a bad argument leaves the dict intact); the returned generator
    then pops lazily. ``device`` must be usable here (not ``"meta"``; ``"cuda"`` only with a GPU).
    """
    if not isinstance(state_dict, MutableMapping):
        raise TypeError(f"state_dict must be a mutable mapping (e.g. dict), got {type(state_dict).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not allowed; use a floating torch dtype such as torch.bfloat16")
    check_int(rows_per_chunk, "rows_per_chunk", minimum=1, allow_none=True, owner="stream_dequantize")
    target = None if device is None else _usable_device(device)
    plan = _plan(state_dict)
    return _stream(state_dict, plan, dtype, target, rows_per_chunk)


def _usable_device(device: torch.device | str) -> torch.device:
    """``device`` resolved, or ``ValueError`` naming it if tensors cannot be created there (meta, no GPU)."""
    dev = resolve_device(device)  # refuses unknown names and "meta"
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as err:  # torch raises AssertionError when built without CUDA
        raise ValueError(f"stream_dequantize(device={device!r}): cannot create tensors there ({err})") from err
    return dev


def _stream(state_dict, plan, dtype, device, rows_per_chunk) -> Iterator[tuple[str, torch.Tensor]]:
    for name, is_pair in plan:
        if not is_pair:
            tensor = state_dict.pop(name)
            yield name, (tensor if device is None else tensor.to(device))
            del tensor
            continue
        blocks = state_dict.pop(name + "_blocks")
        scales = state_dict.pop(name + "_scales")
        target_device = device if device is not None else blocks.device
        out = torch.empty(check_mxfp4(name, blocks.shape, blocks.dtype, scales.shape, scales.dtype),
                          dtype=dtype, device=target_device)
        dequantize_mxfp4(blocks, scales, out=out, rows_per_chunk=rows_per_chunk)
        log.debug("dequantized %s: %s -> %s", name, list(blocks.shape), list(out.shape))
        del blocks, scales
        yield name, out
        del out
