"""A module already quantized by the QLoRA plugin, estimated as it is now: its packed weights copied as fake ones.

A re-plan during the run (or an out-of-memory recovery) estimates the model after the plugin converted it. The
plugin's layers keep the packed weight and its quant state as plain tensors of their own
(:mod:`~lightning_memkit.plugins.packed_state`), which the fake copy copies as any other; bitsandbytes' own layers
(a model loaded quantized) keep them in a tensor subclass (``Params4bit`` with its ``QuantState``; ``Int8Params``
with its row scales ``SCB``), which cannot wrap a fake tensor: :func:`packed_like` gives, for such a weight, a plain
frozen fake ``Parameter`` of the same packed shape and dtype carrying a quant state of fake tensors of the same
shapes, so the copy counts the packed bytes and their quant state as they are. :class:`Converted` is the plugin for
that copy: its forward context and inputs, no conversion (it is done).

Example::

    >>> import torch
    >>> from torch import nn
    >>> from lightning_memkit.estimate.module import ModuleRun
    >>> from lightning_memkit.plugins import NoSaveBitsandbytesPrecision
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.body = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    ...     def training_step(self, batch, batch_idx):
    ...         return self.body(batch).square().mean()
    ...     def configure_optimizers(self):
    ...         return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad])
    >>> plugin = NoSaveBitsandbytesPrecision("nf4", "float32", lora_rank=4)
    >>> net, batch = Net(), torch.randn(8, 64)
    >>> before = ModuleRun(net, batch, plugin=plugin)
    >>> peak = before.estimate(before.base).peak_bytes          # planned before the conversion
    >>> net = plugin.convert_module(net)                         # quantized in place, as the Trainer does
    >>> now = ModuleRun(net, batch, plugin=plugin)
    >>> now.estimate(now.base).peak_bytes - peak    # the same step; the layers' 4-bit code tables (64 B) counted now
    128
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["Converted", "holds_packed", "packed_like"]

_PACKED = ("Params4bit", "Int8Params")


def _is_packed(t: torch.Tensor) -> bool:
    return type(t).__name__ in _PACKED and type(t).__module__.startswith("bitsandbytes")


def holds_packed(module: nn.Module) -> bool:
    """Whether ``module`` has a packed weight (it was quantized: by the plugin, or loaded so by bitsandbytes)."""
    from lightning_memkit.plugins.packed_state import is_packed_layer

    return any(_is_packed(p) for p in module.parameters()) or any(is_packed_layer(m) for m in module.modules())


def packed_like(p: torch.Tensor, like: Any, memo: dict[int, Any]) -> nn.Parameter | None:
    """A frozen fake ``Parameter`` standing for the packed weight ``p`` (``None`` if ``p`` is not one), its quant
    state (4-bit) or row scales (int8) made of fake tensors by ``like``; the objects it replaces go into ``memo``
    (a deep copy's), so that the layer's own references to them are the copy's too."""
    if not _is_packed(p):
        return None
    new = nn.Parameter(like(p.data), requires_grad=False)
    state = getattr(p, "quant_state", None)
    if state is not None:
        new.quant_state = memo.setdefault(id(state), _state_like(state, like))
    scb, cb = getattr(p, "SCB", None), getattr(p, "CB", None)
    if isinstance(scb, torch.Tensor):  # int8's row scales (the layer's state may hold them too)
        new.SCB = memo.setdefault(id(scb), like(scb))
    if isinstance(cb, torch.Tensor):  # int8's CB is the weight's own data
        new.CB = new
        memo.setdefault(id(cb), new)
    return new


def _state_like(state: Any, like: Any) -> Any:
    """A shallow copy of a bitsandbytes ``QuantState`` with every tensor (and the nested state's) made by ``like``."""
    out = copy.copy(state)
    for name, value in vars(state).items():
        if isinstance(value, torch.Tensor):
            setattr(out, name, like(value))
        elif type(value) is type(state):
            setattr(out, name, _state_like(value, like))
    return out


class Converted:
    """The precision ``plugin`` of a model it has converted already: its forward context, input conversion, dtype and
    name; ``convert_module`` leaves the (copied) model as it is."""

    def __init__(self, plugin: Any) -> None:
        self.converted_by = plugin

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module

    def __getattr__(self, name: str) -> Any:
        return getattr(self.converted_by, name)

    def __repr__(self) -> str:
        return repr(self.converted_by)
