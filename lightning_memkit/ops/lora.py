"""Low-rank adapter (LoRA) for a frozen linear layer: ``delta(x) = dropout(x) @ A.T @ B.T * alpha / rank``.

``A`` (``rank x in_features``) starts Kaiming-uniform and ``B`` (``out_features x rank``) at zero, so a
fresh adapter leaves the layer's output unchanged (Hu et al., 2021). The parameters are float32; the
product runs in the input's dtype (``A`` and ``B`` are cast, never the activation), so the graph keeps
``dropout(x)`` (the input itself when ``dropout == 0``) and the ``(..., rank)`` intermediate, nothing
the size of the weight.

Example::

    >>> import torch
    >>> from lightning_memkit.ops.lora import LoRAAdapter
    >>> lora = LoRAAdapter(64, 32, rank=8, alpha=16)
    >>> lora(torch.randn(4, 64)).abs().max().item()   # B starts at zero
    0.0
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_memkit.validation import check_int, check_number

__all__ = ["LoRAAdapter", "check_lora_args"]


def check_lora_args(rank: int, alpha: float, dropout: float, *, owner: str = "LoRAAdapter") -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument when a LoRA setting is out of range."""
    check_int(rank, "lora_rank", minimum=0, owner=owner)  # 0 disables the adapters
    check_number(alpha, "lora_alpha", minimum=0, min_inclusive=False, owner=owner)
    check_number(dropout, "lora_dropout", minimum=0, maximum=1, max_inclusive=False, owner=owner)


class LoRAAdapter(nn.Module):
    """Trainable low-rank update added to a frozen linear layer's output.

    Args:
        in_features: input width of the adapted layer.
        out_features: output width of the adapted layer.
        rank: the adapter's rank ``r`` (>= 1).
        alpha: scaling numerator; the update is multiplied by ``alpha / rank``.
        dropout: dropout probability on the adapter's input (training only).
        device: where the parameters live.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float = 16,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        check_lora_args(rank, alpha, dropout)
        check_int(rank, "lora_rank", minimum=1, owner="LoRAAdapter")
        self.rank = rank
        self.alpha = float(alpha)
        self.scaling = self.alpha / rank
        self.A = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=torch.float32))
        self.B = nn.Parameter(torch.empty(out_features, rank, device=device, dtype=torch.float32))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        nn.init.zeros_(self.B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update ``(..., out_features)`` in ``x``'s dtype."""
        h = torch.nn.functional.linear(self.dropout(x), self.A.to(x.dtype))
        return torch.nn.functional.linear(h, self.B.to(x.dtype)) * self.scaling

    def extra_repr(self) -> str:
        return f"in_features={self.A.shape[1]}, out_features={self.B.shape[0]}, rank={self.rank}, alpha={self.alpha:g}"
