"""A quantized Linear layer whose packed weight is a plain tensor: the plugin's layers on fake tensors.

bitsandbytes keeps a 4-bit weight in ``Params4bit``, a tensor subclass made with ``_make_subclass``, which
cannot wrap a :class:`~torch._subclasses.fake_tensor.FakeTensor`; its quantize and dequantize operators do
run on fake tensors (they register fake kernels). :class:`PackedLinear` holds what a converted layer holds,
the packed weight (``uint8``, ``in * out / 2`` bytes; ``int8`` for LLM.int8) with its quant state, as plain frozen
tensors of the layer (:class:`~lightning_memkit.plugins.packed_state.PackedStateMixin`), made by bitsandbytes' own
``quantize_4bit`` / ``int8_vectorwise_quant``; its forward is the converted layers' forward
(:func:`~lightning_memkit.ops.nosave_matmul.nosave_linear` plus the LoRA adapter).
:class:`~lightning_memkit.plugins.NoSaveBitsandbytesPrecision` installs it instead of its bitsandbytes layers when
the model is on fake tensors, so that :func:`~lightning_memkit.memory.estimate_training_memory` counts a QLoRA step
as it runs. It needs no Lightning: on real tensors it is a QLoRA layer of its own, FSDP2-ready as built.

Example::

    >>> import torch
    >>> from lightning_memkit.plugins.packed_linear import PackedLinear
    >>> layer = PackedLinear.from_linear(torch.nn.Linear(64, 32), "nf4", torch.float32)
    >>> layer.weight.dtype, tuple(layer.weight.shape), layer.packed_quant_state().absmax.numel()  # 64-value blocks
    (torch.uint8, (1024, 1), 32)
    >>> layer(torch.randn(3, 64)).shape
    torch.Size([3, 32])
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_memkit.ops.nosave_matmul import import_bitsandbytes
from lightning_memkit.plugins.nosave_linear import NoSaveLinearMixin

__all__ = ["PackedLinear", "BLOCKSIZE"]

BLOCKSIZE = 64  # bitsandbytes' Params4bit default, which Lightning's 4-bit layers keep


class PackedLinear(NoSaveLinearMixin, nn.Module):
    """A frozen quantized ``Linear``: packed ``weight`` and its quant state (the layer's own tensors), ``bias``,
    optional ``lora``.

    Build it with :meth:`from_linear`. The forward, ``freeze_base`` and ``add_lora`` are those of the plugin's
    layers.
    """

    def __init__(self, in_features: int, out_features: int, bias: nn.Parameter | None,
                 compute_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_parameter("weight", None)  # the packed weight, set by quantize_packed_
        self.bias = bias
        self.compute_dtype = compute_dtype

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str, dtype: torch.dtype) -> PackedLinear:
        """Quantize ``linear``'s weight as the plugin's ``mode`` layer would (4-bit: from ``dtype``; int8: from
        float16, as bitsandbytes does)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias,
                    None if mode == "int8" else dtype)  # LLM.int8 multiplies in the input's dtype
        layer.mode = mode
        layer.quantize_packed_(linear.weight.detach(), linear.weight.device)
        return layer

    def quantize_packed_(self, weight: torch.Tensor, device: torch.device) -> None:
        functional = import_bitsandbytes().functional
        w = weight.to(device=device, dtype=torch.float16 if self.mode == "int8" else self.compute_dtype)
        if self.mode == "int8":
            cb, scb, _ = functional.int8_vectorwise_quant(w)
            self.set_packed_int8_(cb, scb)
        else:
            packed, state = functional.quantize_4bit(w, blocksize=BLOCKSIZE, quant_type=self.mode.split("-")[0],
                                                     compress_statistics=self.mode.endswith("-dq"))
            self.set_packed_4bit_(packed, state)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={self.weight.dtype}"

