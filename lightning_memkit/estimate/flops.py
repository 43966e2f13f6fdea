"""The FLOP formulas of the fake step: torch's own (``FlopCounterMode``'s registry), and the CPU flash attention
kernels that ``scaled_dot_product_attention`` runs on the fake step's CPU tensors, which torch's registry lacks (their
FLOPs were 0: a long sequence's attention, the larger part of its step, was missing from the step time model). They
count as the CUDA flash kernel counts, halved where the kernel is causal (a causal kernel computes the scores of one
triangle: FlashAttention skips the masked blocks).

    >>> import torch
    >>> from lightning_memkit.estimate.flops import flop_registry
    >>> q = torch.empty(1, 4, 1024, 64)
    >>> count = flop_registry()[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu]
    >>> count(q, q, q, 0.0, False, out_val=None), count(q, q, q, 0.0, True, out_val=None)
    (1073741824, 536870912)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["flop_registry"]


def _causal(formula: Callable[..., int], index: int) -> Callable[..., int]:
    """``formula``, halved where the op's ``is_causal`` (its argument ``index``, or the keyword) is true."""

    def count(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        causal = kwargs.get("is_causal", args[index] if len(args) > index else False)
        flops = formula(*args, out_val=out_val, **kwargs)
        return flops // 2 if causal else flops

    return count


@functools.cache
def flop_registry() -> dict[Any, Callable[..., int]]:
    """torch's FLOP formulas by op (``OpOverloadPacket``), with the CPU flash attention kernels added (module doc)."""
    from torch.utils.flop_counter import FlopCounterMode

    registry = dict(FlopCounterMode(display=False).flop_registry)
    aten = torch.ops.aten
    forward, backward = (registry.get(aten._scaled_dot_product_flash_attention),
                         registry.get(aten._scaled_dot_product_flash_attention_backward))
    if forward is not None and hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        registry[aten._scaled_dot_product_flash_attention_for_cpu] = _causal(forward, 4)  # (q, k, v, p, causal)
    if backward is not None and hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        # (grad, q, k, v, out, logsumexp, p, causal)
        registry[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _causal(backward, 7)
    return registry
