"""Linear layers over frozen bitsandbytes weights whose autograd graph keeps only the packed weight.

``nosave_linear(x, layer)`` computes ``x @ W.T + b`` for a 4-bit (nf4/fp4, with or without double
quantization) or an int8 bitsandbytes weight. Forward dequantizes ``W`` into a temporary that dies
with the call; backward re-dequantizes it from the packed weight. What the graph keeps between forward
and backward goes through ``ctx.save_for_backward`` and nothing else: the packed weight (the parameter
itself) and its quantization-state tensors (``absmax``, ``code``, the nested ``absmax``/``code``/
``offset``; ``SCB`` for int8). The input is never kept (the weight is frozen, so backward does not
need it), no dequantized copy is kept, and ``torch.autograd.graph.saved_tensors_hooks`` (activation
offloading, :func:`lightning_memkit.memory.profile_saved_tensors`) sees every tensor kept.

Compared with bitsandbytes' own layers (0.50): ``Linear8bitLt`` keeps its whole input for backward
on a ``ctx`` attribute; ``Linear4bit`` keeps only the packed weight, but on a ``ctx`` attribute that
saved-tensor hooks cannot see, and its backward dequantizes into the weight's original dtype before
casting to the gradient's dtype. Here backward dequantizes straight into the gradient's dtype.

Numerics: on CUDA, 4-bit forward runs ``bitsandbytes.matmul_4bit`` (the kernel bitsandbytes'
``Linear4bit`` uses); on CPU it dequantizes and calls ``F.linear``, as bitsandbytes' CPU fallback does.
Every 4-bit dequantization here asks bitsandbytes for the flat ``(numel,)`` layout and reshapes it:
bitsandbytes' (0.50) native CPU kernel mis-scales some ``(rows, columns)`` requests whose row length is
not a multiple of the block size (rows of 32 or 96 columns, for example), while its flat layout is right. int8
forward computes ``x @ (CB * SCB / 127).T`` in the input's dtype, as bitsandbytes'
``Linear8bitLt`` does during CPU training (on CUDA it multiplies in int8 instead, which quantizes the
activations too). The core is pure torch + bitsandbytes: no Lightning.

Example::

    >>> import torch, bitsandbytes as bnb
    >>> from lightning_memkit.ops.nosave_matmul import nosave_linear
    >>> layer = bnb.nn.Linear4bit(64, 32, quant_type="nf4", compute_dtype=torch.float32).to("cpu")  # quantizes
    >>> x = torch.randn(8, 64, requires_grad=True)
    >>> y = nosave_linear(x, layer)
    >>> y.sum().backward()
    >>> y.shape, x.grad.shape
    (torch.Size([8, 32]), torch.Size([8, 64]))
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from lightning_memkit.measure.fake_repeat import alike_runs, estimating, stands_for

__all__ = [
    "nosave_linear",
    "dequantize_weight",
    "saved_weight_tensors",
    "is_quantized",
    "NoSave4bitLinearFunction",
    "NoSaveInt8LinearFunction",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=1)
def import_bitsandbytes() -> ModuleType:
    """Import bitsandbytes once, without its welcome banner."""
    os.environ.setdefault("BITSANDBYTES_NOWELCOME", "1")
    import bitsandbytes

    return bitsandbytes


# -- recognising the weight ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Packed4bit:
    """The non-tensor half of a 4-bit ``QuantState`` (the tensors travel through ``save_for_backward``)."""

    shape: torch.Size
    blocksize: int
    quant_type: str
    nested_blocksize: int | None
    nested_dtype: torch.dtype | None

    def state(self, absmax, code, offset, nested_absmax, nested_code, dtype: torch.dtype, shape=None):
        """A bitsandbytes ``QuantState`` dequantizing straight into ``dtype`` (``shape``: default ``self.shape``)."""
        qs_cls = import_bitsandbytes().functional.QuantState
        state2 = None
        if self.nested_blocksize is not None:
            state2 = qs_cls(absmax=nested_absmax, code=nested_code, blocksize=self.nested_blocksize,
                            dtype=self.nested_dtype)
        return qs_cls(absmax=absmax, shape=self.shape if shape is None else shape, code=code, blocksize=self.blocksize,
                      quant_type=self.quant_type, dtype=dtype, offset=offset, state2=state2)


def _weight_of(layer_or_weight: Any) -> tuple[torch.Tensor, nn.Module | None]:
    if isinstance(layer_or_weight, nn.Module):
        weight = getattr(layer_or_weight, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"layer_or_weight: {type(layer_or_weight).__name__} has no weight tensor")
        return weight, layer_or_weight
    if isinstance(layer_or_weight, torch.Tensor):
        return layer_or_weight, None
    raise TypeError(
        f"layer_or_weight must be a bitsandbytes Linear4bit/Linear8bitLt layer or its quantized weight, "
        f"got {type(layer_or_weight).__name__}"
    )


def _own_state(layer: nn.Module | None, method: str) -> Any:
    """What a layer that keeps its quant state as its own tensors answers (the plugin's layers: FSDP2 replaces
    the weight parameter, so the state cannot live on it); ``None`` for bitsandbytes' layers."""
    answer = getattr(layer, method, None)
    return answer() if callable(answer) else None


def _quant_state(weight: torch.Tensor, layer: nn.Module | None):
    qs = _own_state(layer, "packed_quant_state")
    if qs is None:
        qs = getattr(weight, "quant_state", None)
    if qs is None and layer is not None:
        qs = getattr(layer, "quant_state", None)
    return qs


def _int8_scales(weight: torch.Tensor, layer: nn.Module | None) -> torch.Tensor | None:
    scb = _own_state(layer, "packed_scales")
    if scb is None:
        scb = getattr(weight, "SCB", None)
    if scb is None and layer is not None:  # bitsandbytes moves CB/SCB to layer.state on its first forward
        scb = getattr(getattr(layer, "state", None), "SCB", None)
    return scb


def _kind(weight: torch.Tensor, layer: nn.Module | None) -> str:
    if weight.dtype == torch.int8:
        if _int8_scales(weight, layer) is None:
            raise ValueError("layer_or_weight: int8 weight without SCB row scales; quantize it with bitsandbytes first")
        return "int8"
    qs = _quant_state(weight, layer)
    if qs is not None and weight.numel() * weight.element_size() == (math.prod(qs.shape) + 1) // 2:
        if getattr(qs, "packing_format_for_cpu", False):
            raise ValueError(
                "layer_or_weight: the 4-bit weight is in bitsandbytes' CPU inference packing (set by an eval-mode "
                "Linear4bit forward); it cannot be used for training"
            )
        return "4bit"
    raise ValueError(
        f"layer_or_weight: weight (dtype {weight.dtype}, shape {tuple(weight.shape)}) is not quantized; allowed: a "
        "bitsandbytes Params4bit with a quant_state or an int8 Int8Params with SCB (quantize with layer.to(device))"
    )


def is_quantized(layer_or_weight: Any) -> bool:
    """Whether ``layer_or_weight`` holds a 4-bit or int8 bitsandbytes weight that :func:`nosave_linear` accepts."""
    try:
        weight, layer = _weight_of(layer_or_weight)
        _kind(weight, layer)
    except (TypeError, ValueError):
        return False
    return True


def _packed_4bit(weight: torch.Tensor, layer: nn.Module | None) -> tuple[Packed4bit, tuple]:
    qs = _quant_state(weight, layer)
    meta = Packed4bit(
        shape=torch.Size(qs.shape), blocksize=int(qs.blocksize), quant_type=qs.quant_type,
        nested_blocksize=int(qs.state2.blocksize) if qs.nested else None,
        nested_dtype=qs.state2.dtype if qs.nested else None,
    )
    nested = (qs.offset, qs.state2.absmax, qs.state2.code) if qs.nested else (None, None, None)
    return meta, (weight, qs.absmax, qs.code, *nested)


def saved_weight_tensors(layer_or_weight: Any) -> list[torch.Tensor]:
    """The tensors :func:`nosave_linear` saves for backward: the packed weight first, then its quant state.

    Their storages already exist (they belong to the parameter), so a forward adds no new bytes.
    """
    weight, layer = _weight_of(layer_or_weight)
    if _kind(weight, layer) == "int8":
        return [weight, _int8_scales(weight, layer)]
    return [t for t in _packed_4bit(weight, layer)[1] if t is not None]


# -- dequantization --------------------------------------------------------------------------------------
def dequantize_int8(cb: torch.Tensor, scb: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Row-wise: W[i, :] = CB[i, :] * SCB[i] / 127, computed directly in ``dtype`` (bitsandbytes' public
    # ``int8_vectorwise_dequant`` returns float32, which would double the temporary for 16-bit compute;
    # this is the expression bitsandbytes' own Linear8bitLt backward uses).
    if scb.device != cb.device:
        scb = scb.to(cb.device)
    return cb.data.to(dtype).mul_(scb.unsqueeze(1).mul(1.0 / 127.0))  # .data: Int8Params overrides .to()


def dequantize_4bit(meta: Packed4bit, tensors: tuple, dtype: torch.dtype) -> torch.Tensor:
    packed, absmax, code, offset, nested_absmax, nested_code = tensors
    # the flat layout (module notes), as one row of n: bitsandbytes' CPU kernel turns a flat shape into (1, n)
    # while its registered fake kernel keeps it flat; (1, n) agrees with both, so torch.compile's check holds
    flat = torch.Size((1, meta.shape.numel()))
    state = meta.state(absmax, code, offset, nested_absmax, nested_code, dtype, shape=flat)
    return import_bitsandbytes().functional.dequantize_4bit(packed.reshape(-1, 1), state).reshape(meta.shape)


def dequantize_weight(layer_or_weight: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A dense ``(out_features, in_features)`` copy of a quantized weight in ``dtype``.

    ``dtype`` defaults to the quant state's dtype (4-bit) or float32 (int8). The reference for the
    dequantize-then-linear path, which keeps this copy alive for backward.
    """
    weight, layer = _weight_of(layer_or_weight)
    if _kind(weight, layer) == "int8":
        return dequantize_int8(weight.data, _int8_scales(weight, layer), dtype or torch.float32)
    meta, tensors = _packed_4bit(weight, layer)
    return dequantize_4bit(meta, (tensors[0].data, *tensors[1:]), dtype or _quant_state(weight, layer).dtype)


# -- autograd functions ----------------------------------------------------------------------------------
def _bias_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.reshape(-1, grad.shape[-1]).sum(0)


class NoSave4bitLinearFunction(torch.autograd.Function):
    """``x @ dequant(W).T + bias`` for a frozen 4-bit weight; saves only the packed weight and its quant state.

    ``apply(x, bias, meta, packed, absmax, code, offset, nested_absmax, nested_code)``; ``x`` and ``bias``
    in the compute dtype. Use :func:`nosave_linear` rather than calling it directly.
    """

    @staticmethod
    def forward(ctx, x, bias, meta, packed, absmax, code, offset, nested_absmax, nested_code):
        if x.device.type == "cuda":
            state = meta.state(absmax, code, offset, nested_absmax, nested_code, x.dtype)
            # grad mode is off: the plain kernel
            out = import_bitsandbytes().matmul_4bit(x, packed.view(-1, 1), state, bias=bias)
        else:
            tensors = (packed, absmax, code, offset, nested_absmax, nested_code)
            out = torch.nn.functional.linear(x, dequantize_4bit(meta, tensors, x.dtype), bias)
        ctx.meta = meta
        ctx.save_for_backward(packed, absmax, code, offset, nested_absmax, nested_code)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _grad_input_4bit(ctx.meta, ctx.saved_tensors, grad)
        if ctx.needs_input_grad[1]:
            grad_bias = _bias_grad(grad)
        return grad_x, grad_bias, None, None, None, None, None, None, None


BACKWARD_CHUNKS = 8  # backward dequantizes the weight in this many row slices: 1/8 of it is dense at a time


def _row_step(meta: Packed4bit) -> int | None:
    """Smallest row count whose elements fill whole quantization blocks (``None``: not row-sliceable)."""
    if len(meta.shape) != 2:
        return None
    out_features, in_features = meta.shape
    step = meta.blocksize // math.gcd(in_features, meta.blocksize)
    return step if step < out_features else None


def _grad_input_4bit(meta: Packed4bit, tensors: tuple, grad: torch.Tensor) -> torch.Tensor:
    """``grad @ dequant(W)``, dequantizing ``W`` one slice of rows at a time (the dense copy is a slice).

    ``grad @ W = sum_k grad[..., rows_k] @ W[rows_k]``; slices end on quantization-block boundaries, so each
    is dequantized from its own bytes of the packed weight and its own absmax values.
    """
    step = _row_step(meta)
    packed, absmax, code, offset, nested_absmax, nested_code = tensors
    if step is None or packed.numel() * 2 != meta.shape.numel():
        w = dequantize_4bit(meta, tensors, grad.dtype)
        return torch.matmul(grad, w)
    out_features, in_features = meta.shape
    bnb_f = import_bitsandbytes().functional
    if meta.nested_blocksize is not None:  # per-block scales are themselves quantized: expand them once
        absmax = bnb_f.dequantize_blockwise(absmax, absmax=nested_absmax, code=nested_code,
                                            blocksize=meta.nested_blocksize) + offset
    rows = max(step, -(-out_features // BACKWARD_CHUNKS) // step * step)
    flat_packed = packed.reshape(-1)
    grad2 = grad.reshape(-1, out_features)
    grad_x = torch.zeros(grad2.shape[0], in_features, dtype=grad.dtype, device=grad.device)
    # fake tensors (an estimate): the slices of full rows are alike, one stands for them all (fake_repeat)
    fake = estimating(grad)
    for r0, count in alike_runs(out_features, rows, fake):
        r1 = min(out_features, r0 + rows)
        e0, e1 = r0 * in_features, r1 * in_features
        state = bnb_f.QuantState(absmax=absmax[e0 // meta.blocksize: -(-e1 // meta.blocksize)],
                                 shape=torch.Size((1, e1 - e0)), code=code, blocksize=meta.blocksize,
                                 quant_type=meta.quant_type, dtype=grad.dtype)  # flat: see the module notes
        with stands_for(count):
            w = bnb_f.dequantize_4bit(flat_packed[e0 // 2: e1 // 2].view(-1, 1), state).reshape(r1 - r0, in_features)
            grad_x.addmm_(grad2[:, r0:r1], w)
            del w
    return grad_x.reshape(*grad.shape[:-1], in_features)


class NoSaveInt8LinearFunction(torch.autograd.Function):
    """``x @ (CB * SCB / 127).T + bias`` for a frozen int8 weight; saves only ``CB`` (the weight) and ``SCB``.

    ``apply(x, bias, cb, scb)``; the product is computed in ``x``'s dtype. Use :func:`nosave_linear`.
    """

    @staticmethod
    def forward(ctx, x, bias, cb, scb):
        w = dequantize_int8(cb, scb, x.dtype)
        out = torch.nn.functional.linear(x, w, bias)
        del w
        ctx.save_for_backward(cb, scb)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            cb, scb = ctx.saved_tensors
            w = dequantize_int8(cb, scb, grad.dtype)
            grad_x = torch.matmul(grad, w)
            del w
        if ctx.needs_input_grad[1]:
            grad_bias = _bias_grad(grad)
        return grad_x, grad_bias, None, None


def _compute_dtype(kind: str, layer: nn.Module | None, x: torch.Tensor, compute_dtype: torch.dtype | None):
    if compute_dtype is None and kind == "4bit" and layer is not None:
        compute_dtype = getattr(layer, "compute_dtype", None)
    dtype = compute_dtype or x.dtype
    if dtype not in FLOAT_DTYPES:
        allowed = ", ".join(map(str, FLOAT_DTYPES))
        raise ValueError(f"compute_dtype={dtype} is not supported; allowed: {allowed}")
    return dtype


def nosave_linear(
    x: torch.Tensor,
    layer_or_weight: Any,
    bias: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` for a frozen bitsandbytes 4-bit or int8 weight, keeping only the packed weight.

    Args:
        x: input ``(..., in_features)``, floating point.
        layer_or_weight: a quantized ``bnb.nn.Linear4bit``/``Linear8bitLt`` (its ``bias`` is used when
            ``bias`` is ``None``) or the weight itself (``Params4bit`` with ``quant_state``, int8 ``Int8Params``
            with ``SCB``).
        bias: optional bias ``(out_features,)``; it may require grad.
        compute_dtype: dtype of the product; default: the layer's ``compute_dtype`` (4-bit) or ``x.dtype``.

    Returns the output in ``x``'s dtype (as bitsandbytes' layers do). Gradients flow to ``x`` and ``bias``;
    the quantized weight gets none.

    Example::

        >>> import torch, bitsandbytes as bnb
        >>> from lightning_memkit.ops.nosave_matmul import nosave_linear
        >>> layer = bnb.nn.Linear8bitLt(16, 8, has_fp16_weights=False).to("cpu")   # int8 weight
        >>> nosave_linear(torch.randn(2, 3, 16), layer).shape
        torch.Size([2, 3, 8])
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    weight, layer = _weight_of(layer_or_weight)
    kind = _kind(weight, layer)
    if bias is None and layer is not None:
        bias = getattr(layer, "bias", None)
    in_features = _quant_state(weight, layer).shape[1] if kind == "4bit" else weight.shape[1]
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features in its last dimension; the weight expects {in_features}")
    dtype = _compute_dtype(kind, layer, x, compute_dtype)
    xc = x.to(dtype)
    bc = bias.to(dtype) if bias is not None else None
    if kind == "int8":
        out = NoSaveInt8LinearFunction.apply(xc, bc, weight, _int8_scales(weight, layer))
    else:
        meta, tensors = _packed_4bit(weight, layer)
        out = NoSave4bitLinearFunction.apply(xc, bc, meta, *tensors)
    return out.to(x.dtype)
