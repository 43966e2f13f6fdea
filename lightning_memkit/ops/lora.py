"""Low-rank adapters (LoRA) for frozen linear layers and frozen MoE experts.

:class:`LoRAAdapter` adapts one linear layer: ``delta(x) = dropout(x) @ A.T @ B.T * alpha / rank``.
:class:`ExpertLoRAAdapter` adapts a stack of experts, one low-rank pair per expert: ``A`` is
``(num_experts, in_features, rank)``, ``B`` is ``(num_experts, rank, out_features)`` and the update of the
tokens routed to expert ``e`` is ``dropout(x) @ A[e] @ B[e] * alpha / rank``.

``A`` (``rank x in_features``) starts Kaiming-uniform and ``B`` (``out_features x rank``) at zero, so a
fresh adapter leaves the layer's output unchanged (Hu et al., 2021). The parameters are float32 and the
update is formed in float32, then rounded once to the input's dtype, as peft computes its adapters on a
bf16 or fp16 base: the adapters' numerics do not change when they are exported to peft. The graph keeps
``dropout(x)`` in its own dtype (the input itself when ``dropout == 0``; backward widens it again) and the
float32 ``(..., rank)`` intermediate, nothing the size of the weight.

Example::

    >>> import torch
    >>> from lightning_memkit.ops.lora import LoRAAdapter
    >>> lora = LoRAAdapter(64, 32, rank=8, alpha=16)
    >>> lora(torch.randn(4, 64)).abs().max().item()   # B starts at zero
    0.0
    >>> from lightning_memkit.ops.lora import ExpertLoRAAdapter
    >>> experts = ExpertLoRAAdapter(num_experts=8, in_features=64, out_features=32, rank=4)
    >>> tuple(experts.A.shape), tuple(experts.B.shape), tuple(experts(torch.randn(5, 64), 3).shape)
    ((8, 64, 4), (8, 4, 32), (5, 32))
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_memkit.common.validation import check_int, check_number
from lightning_memkit.measure.fake_repeat import alike_runs, estimating, stands_for

__all__ = ["LoRAAdapter", "ExpertLoRAAdapter", "check_lora_args", "freeze_base_", "low_rank_update"]


def check_lora_args(rank: int, alpha: float, dropout: float, *, owner: str = "LoRAAdapter") -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument when a LoRA setting is out of range."""
    check_int(rank, "lora_rank", minimum=0, owner=owner)  # 0 disables the adapters
    check_number(alpha, "lora_alpha", minimum=0, min_inclusive=False, owner=owner)
    check_number(dropout, "lora_dropout", minimum=0, maximum=1, max_inclusive=False, owner=owner)


WIDE_SLICE_BYTES = 32 * 2**20  # float32 rows of the input, the update or their gradients: one slice at a time


def _slice_rows(*widths: int) -> int:
    """Rows per slice: their float32 values at the widest of ``widths`` fit :data:`WIDE_SLICE_BYTES`."""
    return max(1, WIDE_SLICE_BYTES // (4 * max(1, *widths)))


def _joined(slices: list[torch.Tensor], like: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The slices' rows as one tensor (no copy for one slice; ``(0, width)`` of ``dtype`` for none)."""
    if len(slices) == 1:
        return slices[0]
    return torch.cat(slices) if slices else like.new_empty(0, width, dtype=dtype)


class _LowRankUpdate(torch.autograd.Function):
    """``(x @ a @ b) * scaling`` in float32, returned in ``x``'s dtype; keeps ``x`` as it came and the float32
    ``(..., rank)`` product. The float32 rows the size of ``x``, the update or their gradients exist one slice
    of rows at a time (peft widens and keeps the whole input, and forms the whole update in float32)."""

    @staticmethod
    def forward(ctx, x, a, b, scaling):  # noqa: D102
        # nothing in place: selective activation checkpointing caches these ops' outputs and refuses mutated ones
        rows = x.reshape(-1, x.shape[-1])
        hs, outs, step = [], [], _slice_rows(a.shape[0], b.shape[1])

        def piece(i: int) -> None:
            hs.append(rows[i:i + step].float() @ a)
            outs.append(((hs[-1] @ b) * scaling).to(x.dtype))

        for i, count in alike_runs(rows.shape[0], step, estimating(x)):
            if count > 1:  # fake tensors: the first count - 1 slices' kept rows as one block each, their ops run once
                with stands_for(1, allocations=0):  # their bytes are counted by the piece standing for them
                    kept = (rows.new_empty((count - 1) * step, a.shape[1], dtype=torch.float32),
                            rows.new_empty((count - 1) * step, b.shape[1], dtype=x.dtype))
                with stands_for(count - 1):
                    piece(i)
                hs[-1], outs[-1] = kept  # the standing piece gives way to the blocks it stands for
                i += (count - 1) * step
            piece(i)
        ctx.save_for_backward(x, a, b, _joined(hs, rows, a.shape[1], torch.float32))
        ctx.scaling = scaling
        return _joined(outs, rows, b.shape[1], x.dtype).reshape(*x.shape[:-1], b.shape[1])

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        x, a, b, h = ctx.saved_tensors
        rows, grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        need_x, need_a, need_b = ctx.needs_input_grad[:3]
        grad_x = torch.empty_like(rows) if need_x else None
        grad_a = torch.zeros_like(a) if need_a else None
        grad_b = torch.zeros_like(b) if need_b else None
        step = _slice_rows(a.shape[0], b.shape[1])
        for i, count in alike_runs(rows.shape[0], step, estimating(x)):  # fake: one slice stands for alike ones
            with stands_for(count):
                g = grad[i:i + step].to(torch.float32, copy=True).mul_(ctx.scaling)  # never the caller's gradient
                gh = g @ b.mT
                if need_x:
                    grad_x[i:i + step] = (gh @ a.mT).to(x.dtype)
                if need_a:
                    grad_a.addmm_(rows[i:i + step].float().mT, gh)
                if need_b:
                    grad_b.addmm_(h[i:i + step].mT, g)
        return grad_x.reshape(x.shape) if need_x else None, grad_a, grad_b, None


def low_rank_update(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``x @ a @ b * scaling`` formed in float32 and rounded once to ``x``'s dtype (peft's adapter numerics).

    ``a`` is ``(in_features, rank)`` and ``b`` ``(rank, out_features)``, float32 (another dtype, such as FSDP2's
    bf16 ``MixedPrecisionPolicy`` copies, is widened first; their gradients go back in it). Autograd keeps ``x`` in
    its own dtype and the float32 ``(..., rank)`` product: a bf16 input costs no more than before it was widened.

    Example::

        >>> import torch
        >>> x, a, b = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(8, 2), torch.randn(2, 4)
        >>> out = low_rank_update(x, a, b, 0.5)
        >>> out.dtype, torch.equal(out, (x.float() @ a @ b * 0.5).bfloat16())
        (torch.bfloat16, True)
    """
    return _LowRankUpdate.apply(x, a.float(), b.float(), scaling)


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
        """The update ``(..., out_features)``, formed in float32, in ``x``'s dtype."""
        return low_rank_update(self.dropout(x), self.A.t(), self.B.t(), self.scaling)

    def extra_repr(self) -> str:
        return f"in_features={self.A.shape[1]}, out_features={self.B.shape[0]}, rank={self.rank}, alpha={self.alpha:g}"


class ExpertLoRAAdapter(nn.Module):
    """One trainable low-rank update per expert, added to the output of a stack of frozen experts.

    Args:
        num_experts: number of experts ``E``.
        in_features: input width of each expert's projection.
        out_features: output width of each expert's projection.
        rank: the adapters' rank ``r`` (>= 1).
        alpha: scaling numerator; the update is multiplied by ``alpha / rank``.
        dropout: dropout probability on the adapters' input (training only).
        device: where the parameters live.

    ``A[e]`` starts uniform in ``+-1/sqrt(in_features)`` (the bound :class:`LoRAAdapter`'s Kaiming init gives)
    and ``B`` at zero. Parameters are float32; ``forward(x, e)`` forms expert ``e``'s update in float32 and
    returns it in ``x``'s dtype, so the graph keeps ``dropout(x)`` and the float32 ``(..., rank)`` intermediate.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, rank: int, alpha: float = 16,
                 dropout: float = 0.0, device: torch.device | str | None = None):
        super().__init__()
        owner = "ExpertLoRAAdapter"
        check_lora_args(rank, alpha, dropout, owner=owner)
        for value, name in ((rank, "lora_rank"), (num_experts, "num_experts"), (in_features, "in_features"),
                            (out_features, "out_features")):
            check_int(value, name, minimum=1, owner=owner)
        self.rank = rank
        self.alpha = float(alpha)
        self.scaling = self.alpha / rank
        self.A = nn.Parameter(torch.empty(num_experts, in_features, rank, device=device, dtype=torch.float32))
        self.B = nn.Parameter(torch.empty(num_experts, rank, out_features, device=device, dtype=torch.float32))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1 / math.sqrt(self.A.shape[1])
        nn.init.uniform_(self.A, -bound, bound)
        nn.init.zeros_(self.B)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """The update ``(..., out_features)`` of expert ``expert`` for its tokens ``x``, in ``x``'s dtype."""
        return low_rank_update(self.dropout(x), self.A[expert], self.B[expert], self.scaling)

    def extra_repr(self) -> str:
        e, i, r = self.A.shape
        return f"num_experts={e}, in_features={i}, out_features={self.B.shape[2]}, rank={r}, alpha={self.alpha:g}"


def freeze_base_(module: nn.Module, dtype: torch.dtype | None = None) -> list[str]:
    """Freeze every parameter of ``module`` that no LoRA adapter owns and cast the floating ones to ``dtype``.

    Casting keeps each ``Parameter`` object (its ``data`` is replaced). Returns the names of the parameters frozen.

    Example::

        >>> import torch
        >>> from lightning_memkit.ops.lora import LoRAAdapter, freeze_base_
        >>> net = torch.nn.ModuleDict({"proj": torch.nn.Linear(8, 8), "norm": torch.nn.LayerNorm(8)})
        >>> net.proj.lora = LoRAAdapter(8, 8, rank=2)
        >>> freeze_base_(net, torch.bfloat16)
        ['proj.weight', 'proj.bias', 'norm.weight', 'norm.bias']
        >>> [(n, p.dtype, p.requires_grad) for n, p in net.named_parameters() if n.startswith("proj.lora")]
        [('proj.lora.A', torch.float32, True), ('proj.lora.B', torch.float32, True)]
    """
    adapters = {id(p) for m in module.modules() if isinstance(m, (LoRAAdapter, ExpertLoRAAdapter))
                for p in m.parameters()}
    frozen = []
    for name, p in module.named_parameters():
        if id(p) in adapters:
            continue
        p.requires_grad_(False)
        if dtype is not None and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
        frozen.append(name)
    return frozen
