"""Frozen mixture-of-experts weights stored quantized, one packed matrix per expert, used through the no-save matmul.

An MoE layer keeps its experts as one 3-D tensor per projection, ``(num_experts, out, in)`` (or
``(num_experts, in, out)``). :class:`QuantizedExperts` quantizes each expert's matrix on its own (4-bit
nf4/fp4, optionally double-quantized, or int8 row-wise, the modes of bitsandbytes) and stacks the packed
bytes: ``weight`` is a frozen ``(num_experts, packed bytes)`` parameter, the quantization state sits in
buffers (``absmax``, ``code``, ``offset``, ``nested_absmax``, ``nested_code``; ``scb`` for int8), so a
state dict saves and restores the exact packed weights.

``experts(x, e)`` computes ``x @ W_e.T (+ bias)`` with the autograd functions of
:mod:`lightning_memkit.ops.nosave_matmul`: forward dequantizes expert ``e`` into a temporary, and what the
graph keeps for backward is expert ``e``'s slice of the packed weight and of its quantization state
(views of the module's own storage, so a forward adds no bytes), never the input, never a dequantized
copy. The core is pure torch + bitsandbytes.

Example::

    >>> import torch
    >>> from lightning_memkit.ops.nosave_experts import QuantizedExperts
    >>> dense = torch.randn(4, 32, 16)                     # 4 experts, (out=32, in=16) each
    >>> experts = QuantizedExperts.from_weight(dense, "nf4")
    >>> experts.weight.dtype, tuple(experts.weight.shape)   # 32 * 16 / 2 bytes per expert
    (torch.uint8, (4, 256))
    >>> x = torch.randn(5, 16, requires_grad=True)
    >>> y = experts(x, 2)                                  # expert 2
    >>> y.sum().backward()
    >>> y.shape, x.grad.shape
    (torch.Size([5, 32]), torch.Size([5, 16]))
    >>> bool((experts.dequantize(2) - dense[2]).abs().max() < 0.25 * dense[2].abs().max())
    True
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from lightning_memkit.common.validation import check_bool, check_choice, check_int
from lightning_memkit.measure.fake_repeat import alike_runs, estimating, stands_for
from lightning_memkit.ops.nosave_matmul import (
    FLOAT_DTYPES,
    NoSave4bitLinearFunction,
    NoSaveInt8LinearFunction,
    Packed4bit,
    dequantize_4bit,
    dequantize_int8,
    import_bitsandbytes,
)

__all__ = ["QuantizedExperts", "EXPERT_MODES", "check_expert_weight"]

EXPERT_MODES = ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8")
_BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # bitsandbytes' 4-bit block sizes on every backend
_NESTED_BLOCKSIZE = 256  # bitsandbytes' block size for the double-quantized absmax
_OWNER = "QuantizedExperts"


def check_expert_weight(weight: object, name: str = "weight") -> torch.Tensor:
    """``weight`` if it is a floating 3-D tensor with data (not on the meta device) and non-empty experts."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{_OWNER}: {name} must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 3 or not weight.is_floating_point():
        raise ValueError(f"{_OWNER}: {name} must be a floating 3-D tensor (num_experts, rows, columns), got "
                         f"{weight.dtype} of shape {tuple(weight.shape)}")
    if weight.numel() == 0:
        raise ValueError(f"{_OWNER}: {name} of shape {tuple(weight.shape)} has no elements to quantize")
    if weight.device.type == "meta":
        raise ValueError(f"{_OWNER}: {name} is on the meta device; load or materialize the weights before "
                         "quantizing them")
    return weight


class QuantizedExperts(nn.Module):
    """``num_experts`` frozen ``(out_features, in_features)`` matrices, quantized expert by expert.

    Build one with :meth:`from_weight`. The constructor allocates empty storage of the right sizes (a
    state dict can then fill it).

    Args:
        num_experts: number of experts ``E``.
        in_features: columns of each expert's matrix (the input width).
        out_features: rows of each expert's matrix (the output width).
        mode: ``"nf4"``, ``"nf4-dq"``, ``"fp4"``, ``"fp4-dq"`` (4-bit; ``-dq``: the per-block scales are
            quantized too) or ``"int8"`` (row-wise absmax, as bitsandbytes' LLM.int8 weights).
        compute_dtype: dtype of the product; ``None``: the input's dtype. The output has the input's dtype.
        blocksize: 4-bit quantization block size (elements per absmax).
        device: where the storage lives.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, mode: str, *,
                 compute_dtype: torch.dtype | None = None, blocksize: int = 64,
                 device: torch.device | str | None = None):
        super().__init__()
        for value, name in ((num_experts, "num_experts"), (in_features, "in_features"),
                            (out_features, "out_features")):
            check_int(value, name, minimum=1, owner=_OWNER)
        check_choice(mode, "mode", EXPERT_MODES, owner=_OWNER)
        check_choice(blocksize, "blocksize", _BLOCKSIZES, owner=_OWNER)
        if compute_dtype is not None and compute_dtype not in FLOAT_DTYPES:
            raise ValueError(f"{_OWNER}(compute_dtype={compute_dtype}): must be one of "
                             f"{', '.join(map(str, FLOAT_DTYPES))} or None")
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.mode, self.compute_dtype, self.blocksize = mode, compute_dtype, blocksize
        self._allocate(device)

    # -- storage ---------------------------------------------------------------------------------------
    def _allocate(self, device) -> None:
        e, n = self.num_experts, self.in_features * self.out_features
        if self.mode == "int8":
            self.weight = nn.Parameter(torch.zeros(e, self.out_features, self.in_features, dtype=torch.int8,
                                                   device=device), requires_grad=False)
            self.register_buffer("scb", torch.ones(e, self.out_features, device=device))
            return
        blocks = -(-n // self.blocksize)
        self.weight = nn.Parameter(torch.zeros(e, (n + 1) // 2, dtype=torch.uint8, device=device),
                                   requires_grad=False)
        self.register_buffer("code", torch.zeros(16, device=device))
        if self.nested:
            self.register_buffer("absmax", torch.zeros(e, blocks, dtype=torch.uint8, device=device))
            self.register_buffer("offset", torch.zeros(e, device=device))
            self.register_buffer("nested_absmax", torch.zeros(e, -(-blocks // _NESTED_BLOCKSIZE), device=device))
            self.register_buffer("nested_code", torch.zeros(256, device=device))
        else:
            self.register_buffer("absmax", torch.zeros(e, blocks, device=device))

    @property
    def nested(self) -> bool:
        """Whether the 4-bit block scales are themselves quantized (``-dq`` modes)."""
        return self.mode.endswith("-dq")

    @property
    def _meta(self) -> Packed4bit:
        return Packed4bit(shape=torch.Size((self.out_features, self.in_features)), blocksize=self.blocksize,
                           quant_type=self.mode[:3], nested_blocksize=_NESTED_BLOCKSIZE if self.nested else None,
                           nested_dtype=torch.float32 if self.nested else None)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, mode: str, *, transposed: bool = False,
                    compute_dtype: torch.dtype | None = None, blocksize: int = 64) -> QuantizedExperts:
        """Quantize a dense ``(E, out, in)`` tensor (``transposed=True``: ``(E, in, out)``), expert by expert.

        The result lives on ``weight``'s device; ``weight`` is not modified. Only one expert's float32 copy
        exists at a time besides the packed result. On fake tensors (an estimate) the first expert's quantization
        stands for every one's (:mod:`~lightning_memkit.measure.fake_repeat`: the same storages come and go).
        """
        check_expert_weight(weight)
        check_bool(transposed, "transposed", owner=_OWNER)
        e, rows, cols = weight.shape
        out_f, in_f = (cols, rows) if transposed else (rows, cols)
        experts = cls(e, in_f, out_f, mode, compute_dtype=compute_dtype, blocksize=blocksize, device=weight.device)
        with torch.no_grad():
            for i, count in alike_runs(e, 1, estimating(weight)):
                w = weight[i].t() if transposed else weight[i]
                with stands_for(count):
                    experts._store(i, w.detach().to(torch.float32).contiguous())
        return experts

    def _store(self, i: int, w: torch.Tensor) -> None:
        functional = import_bitsandbytes().functional
        if self.mode == "int8":  # from float16, as bitsandbytes' and Lightning's int8 layers (CUDA accepts no other)
            w16 = w.to(torch.float16)
            if not is_fake(w16) and not torch.isfinite(w16).all():  # an estimate knows no values
                raise ValueError(f"{_OWNER}: expert {i} has values beyond float16's range (max |w| = "
                                 f"{w.abs().max().item():.4g}); int8 quantizes a float16 copy")
            cb, scb, _ = functional.int8_vectorwise_quant(w16)
            self.weight[i].copy_(cb)
            self.scb[i].copy_(scb)
            return
        packed, state = functional.quantize_4bit(w, blocksize=self.blocksize, compress_statistics=self.nested,
                                                 quant_type=self.mode[:3])
        self.weight[i].copy_(packed.reshape(-1))
        self.absmax[i].copy_(state.absmax)
        self.code.copy_(state.code)
        if self.nested:
            self.offset[i] = state.offset
            self.nested_absmax[i].copy_(state.state2.absmax)
            self.nested_code.copy_(state.state2.code)

    # -- use -------------------------------------------------------------------------------------------
    def _expert(self, expert) -> int:
        if isinstance(expert, torch.Tensor) and expert.numel() == 1 and not expert.is_floating_point():
            expert = int(expert)
        if isinstance(expert, bool) or not isinstance(expert, int) or not 0 <= expert < self.num_experts:
            raise ValueError(f"{_OWNER}: expert={expert!r} is out of range; allowed: an int 0 .. "
                             f"{self.num_experts - 1}")
        return expert

    def saved_tensors(self, expert: int) -> list[torch.Tensor]:
        """What a forward through ``expert`` keeps for backward: its packed slice first, then its quant state."""
        e = self._expert(expert)
        if self.mode == "int8":
            return [self.weight[e], self.scb[e]]
        if self.nested:
            return [self.weight[e], self.absmax[e], self.code, self.offset[e], self.nested_absmax[e],
                    self.nested_code]
        return [self.weight[e], self.absmax[e], self.code]

    def _state_tensors(self, e: int) -> tuple:
        if self.nested:
            return (self.weight[e], self.absmax[e], self.code, self.offset[e], self.nested_absmax[e],
                    self.nested_code)
        return self.weight[e], self.absmax[e], self.code, None, None, None

    def dequantize(self, expert: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A dense ``(out, in)`` copy of ``expert``'s matrix in ``dtype`` (``expert=None``: all, ``(E, out, in)``)."""
        if expert is None:
            return torch.stack([self.dequantize(e, dtype) for e in range(self.num_experts)])
        e = self._expert(expert)
        with torch.no_grad():
            if self.mode == "int8":
                return dequantize_int8(self.weight[e], self.scb[e], dtype)
            return dequantize_4bit(self._meta, self._state_tensors(e), dtype)

    def forward(self, x: torch.Tensor, expert: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W_expert.T + bias`` in ``x``'s dtype; gradients flow to ``x`` and ``bias``, never to ``W``."""
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{_OWNER}: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{_OWNER}: x has {x.shape[-1]} features in its last dimension; the experts expect "
                             f"{self.in_features}")
        e = self._expert(expert)
        dtype = self.compute_dtype or x.dtype
        xc = x.to(dtype)
        bc = bias.to(dtype) if bias is not None else None
        if self.mode == "int8":
            out = NoSaveInt8LinearFunction.apply(xc, bc, self.weight[e], self.scb[e])
        else:
            out = NoSave4bitLinearFunction.apply(xc, bc, self._meta, *self._state_tensors(e))
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        dtype = "" if self.compute_dtype is None else f", compute_dtype={self.compute_dtype}"
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}, "
                f"mode={self.mode!r}{dtype}")
