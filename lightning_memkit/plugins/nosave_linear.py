"""The forward and the LoRA of every no-save quantized Linear layer (bitsandbytes-backed, or packed for estimates).

A layer class mixes :class:`NoSaveLinearMixin` in front of its bitsandbytes (or plain) base: its forward runs
:func:`~lightning_memkit.ops.nosave_matmul.nosave_linear`, whose backward keeps only the packed weight, plus the
layer's LoRA update when it has one. The packed weight and its quant state are the layer's own plain tensors
(:class:`~lightning_memkit.plugins.packed_state.PackedStateMixin`), so the layer trains under FSDP2 as built.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_memkit.ops.lora import LoRAAdapter
from lightning_memkit.ops.nosave_matmul import nosave_linear
from lightning_memkit.plugins.packed_state import PackedStateMixin

__all__ = ["NoSaveLinearMixin"]


def _quantize_device(layer: nn.Module, weight: torch.Tensor | None, device: Any) -> torch.device:
    if device is not None:
        return torch.device(device)
    for t in (layer.weight, weight):
        if t is not None and t.device.type != "meta":
            return t.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class NoSaveLinearMixin(PackedStateMixin):
    """Forward through :func:`nosave_linear` (+ the LoRA update when the layer has one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nosave_linear(x, self)
        lora = self._modules.get("lora")
        return out if lora is None else out + lora(x)

    def quantize_(self, weight: torch.Tensor | None = None, device: Any = None) -> None:
        """Quantize in place on ``device`` (default: where the weight is; Lightning's default is CUDA).

        ``weight`` (a state dict's, through Lightning's load hook) must be unquantized: packed bytes would be
        quantized again as if they were values.
        """
        if weight is not None and weight is self.weight:
            return  # the packed weight :meth:`_load_from_state_dict` restored, handed back by the load hook
        if weight is not None and not weight.is_floating_point():
            raise ValueError(
                f"{type(self).__name__}: cannot load a {weight.dtype} weight of shape {tuple(weight.shape)}: it is "
                "already quantized (a state dict of a converted model); load the unquantized weights, or load the "
                "state dict into the model before the plugin converts it"
            )
        if weight is None:
            if self.is_quantized:
                return
            weight = self.weight.data
        self.quantize_packed_(weight, _quantize_device(self, weight, device))

    def quantize_packed_(self, weight: torch.Tensor, device: torch.device) -> None:
        """Quantize the unquantized ``weight`` on ``device`` into this layer's packed weight (per quantization kind)."""
        raise NotImplementedError(f"{type(self).__name__} cannot quantize a weight")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """A packed weight (a converted model's state dict, e.g. a checkpoint to resume) is restored as it was
        saved, bit for bit, with its quant state; an unquantized one is quantized (cast to :attr:`source_dtype`
        first, where the layer has one)."""
        weight = state_dict.get(prefix + "weight")
        if weight is not None and weight.is_floating_point():
            self.quantize_(weight)
        elif weight is not None and self.is_quantized:
            self.load_packed_(weight, state_dict, prefix)
        if self.packed_kind is not None:  # the weight and its quant state copied onto themselves: they are loaded
            state_dict = self._own_entries(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def load_packed_(self, packed: torch.Tensor, state_dict: dict, prefix: str) -> None:
        """Restore this layer's packed weight from a converted state dict (per quantization kind)."""
        raise NotImplementedError(f"{type(self).__name__} cannot load a packed weight")

    def check_packed(self, packed: torch.Tensor, kind: str) -> None:
        """A packed weight of another layout (another mode, shape or model) is refused, not loaded."""
        if packed.dtype != self.weight.dtype or packed.shape != self.weight.shape:
            raise ValueError(
                f"{type(self).__name__}: the state dict's packed weight ({packed.dtype}, {tuple(packed.shape)}) is "
                f"not this layer's layout ({self.weight.dtype}, {tuple(self.weight.shape)}, {kind}): it was saved "
                "with another quantization mode or model"
            )

    @property
    def is_quantized(self) -> bool:
        return self.weight.dtype in (torch.uint8, torch.int8) or bool(getattr(self.weight, "bnb_quantized", False))

    def freeze_base(self) -> None:
        """Freeze the quantized weight and the bias (Lightning's 4-bit conversion already freezes the bias)."""
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def add_lora(self, rank: int, alpha: float = 16, dropout: float = 0.0) -> LoRAAdapter:
        """Attach a trainable LoRA adapter (once) and freeze the layer's own parameters."""
        if self._modules.get("lora") is None:
            device = self.weight.device if self.weight.device.type != "meta" else torch.device("cpu")
            self.lora = LoRAAdapter(self.in_features, self.out_features, rank, alpha, dropout, device=device)
        self.freeze_base()
        return self.lora
