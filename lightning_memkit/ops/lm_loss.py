"""One call for the loss of a language-model head, fused (no ``(N, V)`` logits) or standard.

Use it in a LightningModule's step: split the model so it returns the hidden states that enter the
head, then let :func:`lm_head_loss` apply the head and the loss.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from lightning_memkit.ops.lm_loss import lm_head_loss
    >>> head = nn.Linear(16, 100, bias=False)
    >>> hidden = torch.randn(2, 5, 16, requires_grad=True)   # (batch, time, d_model)
    >>> targets = torch.randint(0, 100, (2, 5))               # already aligned with hidden
    >>> fused = lm_head_loss(hidden, head, targets)
    >>> plain = lm_head_loss(hidden, head, targets, fused=False)
    >>> torch.allclose(fused, plain, atol=1e-5)
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_memkit.ops._head_numerics import HALF, check_logits_dtype
from lightning_memkit.ops.cross_entropy import cross_entropy
from lightning_memkit.ops.linear_cross_entropy import linear_cross_entropy

__all__ = ["lm_head_loss"]

_FUSED_ONLY = ("chunk_size", "chunk_bytes", "accum_dtype", "class_weights", "shift", "token_scaling", "return_lse",
               "return_accuracy", "return_z_loss", "return_predicted_tokens")


def lm_head_loss(
    hidden: torch.Tensor, lm_head: nn.Linear, targets: torch.Tensor, *, fused: bool = True, **options
) -> torch.Tensor:
    """Cross-entropy of ``lm_head(hidden)`` against ``targets``.

    Nothing is shifted: ``targets[..., i]`` must already be the class predicted from
    ``hidden[..., i, :]`` (for next-token prediction pass ``hidden[:, :-1]`` and ``tokens[:, 1:]``, or a
    data module that yields shifted pairs).

    Args:
        hidden: ``(..., H)`` hidden states entering the head.
        lm_head: the ``nn.Linear(H, V)`` head (its bias is used when present).
        targets: ``(...)`` class indices; ``ignore_index`` (default -100) marks tokens to skip.
        fused: ``True`` calls :func:`~lightning_memkit.ops.linear_cross_entropy` (the logits are never
            materialized); ``False`` applies the head and :func:`~lightning_memkit.ops.cross_entropy`.
        options: forwarded to the chosen op (``ignore_index``, ``label_smoothing``, ``z_loss``,
            ``softcap``, ``reduction``, ...; ``chunk_size``, ``chunk_bytes``, ``accum_dtype``, ``class_weights``,
            ``shift``, ``token_scaling`` and the ``return_*`` outputs need ``fused=True``). ``logits_dtype``
            applies to both: ``torch.float32`` (default) forms the logits, bias and ``softcap`` in float32 (with
            ``fused=False`` from float32 copies of the head), ``"head"`` in the head's dtype
            (:func:`~lightning_memkit.ops.linear_cross_entropy`).
    """
    if not isinstance(lm_head, nn.Linear):
        raise TypeError(
            f"lm_head must be an nn.Linear, got {type(lm_head).__name__}; for a tied or custom head call "
            "linear_cross_entropy(hidden, weight, targets) directly"
        )
    if not isinstance(fused, bool):
        raise TypeError(f"fused must be a bool, got {fused!r}")
    if fused:
        return linear_cross_entropy(hidden, lm_head.weight, targets, bias=lm_head.bias, **options)
    extra = [k for k in _FUSED_ONLY if k in options]
    if extra:
        raise ValueError(f"{', '.join(extra)} only apply with fused=True")
    rounded = check_logits_dtype(options.pop("logits_dtype", torch.float32), hidden.dtype, "lm_head_loss")
    if rounded is not None or hidden.dtype not in HALF:  # the head's numerics, or no half dtype to leave
        return cross_entropy(lm_head(hidden), targets, **options)
    bias = None if lm_head.bias is None else lm_head.bias.float()
    return cross_entropy(F.linear(hidden.float(), lm_head.weight.float(), bias), targets, **options)
