"""A quantized Linear layer's packed weight and quant state as plain tensors of the layer: ready for FSDP2 as built.

bitsandbytes keeps a packed weight in a tensor subclass (``Params4bit``, ``Int8Params``) with its quant state
attached to that parameter object. ``torch.distributed.fsdp.fully_shard`` replaces every parameter by a ``DTensor``
over a plain tensor, so the quant state would be gone in forward. :class:`PackedStateMixin` keeps everything as
tensors of the layer itself, which FSDP2 shards, gathers and restores byte for byte:

- ``weight``: the packed bytes, a plain frozen ``nn.Parameter`` (4-bit: ``uint8`` ``(n/2, 1)``; int8: ``int8``
  ``(out, in)``);
- the quant state that grows with the weight, frozen flat ``uint8`` parameters of its bytes, sharded with the weight
  and viewed back to their dtype where used (a ``MixedPrecisionPolicy`` never casts a byte parameter):
  ``absmax_bytes`` (4-bit block scales), ``nested_absmax_bytes`` (double quantization's), ``scb_bytes`` (int8 row
  scales);
- the constant tables, byte buffers kept out of the state dict (replicated; ``module.to(dtype)`` leaves them):
  ``quant_map_bytes``, ``nested_quant_map_bytes``, ``nested_offset_bytes``;
- the rest (shape, block sizes, quant type, dtypes) as plain attributes (:attr:`PackedStateMixin.packed_meta`).

Forward reads the quant state from these tensors (inside FSDP2's forward: views of its unsharded parameters).
State dicts keep bitsandbytes' keys and values (``weight.absmax``, ``weight.quant_map``, ...,
``weight.quant_state.bitsandbytes__nf4``; int8: ``SCB``, ``weight_format``); under FSDP2 the sharded quant state is
gathered whole into them (every rank calls ``state_dict``, as FSDP2 needs anyway) and loading puts each rank's shard
back; a double-quantized state's packed JSON ends in spaces up to a width its nested offset does not change, so that
``torch.distributed.checkpoint`` loads it into any model of the same shapes. The weight parameter also carries
bitsandbytes' attribute names (``quant_state``, ``quant_type``, ``blocksize``, ``compress_statistics``; int8:
``SCB``, ``CB``) as views of these tensors, for code written against bitsandbytes' parameters (peft, memory
reports); nothing the layer runs reads them.

Example::

    >>> import torch
    >>> from lightning_memkit.plugins.packed_linear import PackedLinear
    >>> layer = PackedLinear.from_linear(torch.nn.Linear(64, 32), "nf4", torch.float32)
    >>> sorted((n, p.dtype, type(p).__name__) for n, p in layer.named_parameters())  # doctest: +NORMALIZE_WHITESPACE
    [('absmax_bytes', torch.uint8, 'Parameter'), ('bias', torch.float32, 'Parameter'),
     ('weight', torch.uint8, 'Parameter')]
    >>> [k for k in layer.state_dict()]
    ['weight', 'bias', 'weight.absmax', 'weight.quant_map', 'weight.quant_state.bitsandbytes__nf4']
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch import nn

from lightning_memkit.ops.nosave_matmul import Packed4bit

__all__ = ["PackedStateMixin", "is_packed_layer", "STATE_PARAMETERS"]

ABSMAX, NESTED_ABSMAX, SCB = "absmax_bytes", "nested_absmax_bytes", "scb_bytes"
QUANT_MAP, NESTED_QUANT_MAP, NESTED_OFFSET = "quant_map_bytes", "nested_quant_map_bytes", "nested_offset_bytes"
#: the byte parameters that hold a packed layer's quant state (sharded with the weight under FSDP2)
STATE_PARAMETERS = (ABSMAX, NESTED_ABSMAX, SCB)
_STATE_BUFFERS = (QUANT_MAP, NESTED_QUANT_MAP, NESTED_OFFSET)
_INT8_KEYS = ("SCB", "weight_format")  # bitsandbytes' int8 state-dict keys beside the weight
_OFFSET_WIDTH = 32  # characters the nested offset takes in the packed JSON (a float's repr takes at most 24)


def is_packed_layer(module: nn.Module) -> bool:
    """Whether ``module`` holds a packed weight as :class:`PackedStateMixin` keeps it.

    Example::

        >>> from lightning_memkit.plugins import NoSaveBitsandbytesPrecision
        >>> model = NoSaveBitsandbytesPrecision("int8").convert_module(nn.Sequential(nn.Linear(64, 32), nn.ReLU()))
        >>> [is_packed_layer(m) for m in model], model[0].packed_scales().shape
        ([True, False], torch.Size([32]))
    """
    return isinstance(module, PackedStateMixin) and module.packed_kind is not None


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``, flat ``uint8``, sharing its storage."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor`` (none exists before ``torch.distributed.tensor`` is imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t``, gathered whole if it is a ``DTensor`` (FSDP2's sharded parameter outside forward)."""
    return t.full_tensor() if _is_dtensor(t) else t


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` in place; a whole ``src`` into a sharded ``dst`` lands as this rank's shard."""
    with torch.no_grad():
        if _is_dtensor(dst) and not _is_dtensor(src):
            from torch.distributed.tensor import distribute_tensor

            src = distribute_tensor(src.to(dst.device), dst.device_mesh, dst.placements, src_data_rank=None)
        dst.copy_(src)


def _fits(current: torch.Tensor | None, value: torch.Tensor) -> bool:
    return (current is not None and current.device.type != "meta" and current.dtype == value.dtype
            and current.shape == value.shape)


class PackedStateMixin:
    """The packed weight and its quant state as the layer's own plain tensors (see the module)."""

    #: the non-tensor half of a 4-bit quant state (``None``: int8 or not quantized)
    packed_meta: Packed4bit | None = None
    #: the dtype a 4-bit weight was quantized from (bitsandbytes' ``QuantState.dtype``)
    packed_dtype: torch.dtype | None = None
    weight_format = "row"  # int8: bitsandbytes' state-dict key beside SCB (``torch.distributed.checkpoint`` reads it)

    @property
    def packed_kind(self) -> str | None:
        """``"4bit"``, ``"int8"`` or ``None`` (not quantized yet)."""
        if self.packed_meta is not None:
            return "4bit"
        return "int8" if SCB in self._parameters else None

    @property
    def SCB(self) -> torch.Tensor | None:  # noqa: N802 - bitsandbytes' name, a state-dict key
        """int8: the float32 row scales (a sharded layer's byte parameter, outside forward); else ``None``."""
        p = self._parameters.get(SCB)
        return None if p is None else (p if _is_dtensor(p) else self._view(SCB))

    # -- installing -----------------------------------------------------------------------------------------
    def set_packed_4bit_(self, packed: torch.Tensor, state: Any) -> None:
        """Hold ``packed`` (4-bit bytes) with bitsandbytes' ``QuantState`` ``state``: in place where the layer holds
        tensors of these sizes already (a state dict loaded, FSDP2's shards included), else as new tensors sharing
        ``state``'s storages."""
        nested = state.state2 if state.nested else None
        self.packed_meta = Packed4bit(
            shape=torch.Size(state.shape), blocksize=int(state.blocksize), quant_type=state.quant_type,
            nested_blocksize=int(nested.blocksize) if nested is not None else None,
            nested_dtype=nested.dtype if nested is not None else None)
        self.packed_dtype = state.dtype
        self._put("weight", packed, as_bytes=False)
        self._put(ABSMAX, state.absmax)
        self._put(QUANT_MAP, state.code)
        if nested is not None:
            self._put(NESTED_ABSMAX, nested.absmax)
            self._put(NESTED_QUANT_MAP, nested.code)
            self._put(NESTED_OFFSET, state.offset)
        self.mirror_bitsandbytes_attributes()

    def set_packed_int8_(self, cb: torch.Tensor, scb: torch.Tensor) -> None:
        """Hold the int8 weight ``cb`` with its float32 row scales ``scb`` (in place as :meth:`set_packed_4bit_`)."""
        self.packed_meta = self.packed_dtype = None
        self._put("weight", cb, as_bytes=False)
        self._put(SCB, scb.to(torch.float32))
        self.mirror_bitsandbytes_attributes()

    def _put(self, name: str, value: torch.Tensor, as_bytes: bool = True) -> None:
        if as_bytes:
            self.__dict__.setdefault("_byte_views", {})[name] = (value.dtype, tuple(value.shape))
            value = _as_bytes(value)
        current = self._parameters.get(name, self._buffers.get(name))
        if _fits(current, value):
            _copy_into(current, value)
        elif name in _STATE_BUFFERS:
            self.register_buffer(name, value, persistent=False)
        else:
            self.register_parameter(name, nn.Parameter(value, requires_grad=False))

    # -- reading --------------------------------------------------------------------------------------------
    def _view(self, name: str) -> torch.Tensor | None:
        """The tensor ``name`` holds the bytes of, in its dtype and shape (a view; gathered if sharded)."""
        t = self._parameters.get(name, self._buffers.get(name))
        if t is None:
            return None
        dtype, shape = self._byte_views[name]
        return _whole(t).view(dtype).reshape(shape)

    def packed_quant_state(self) -> Any:
        """bitsandbytes' ``QuantState`` of the 4-bit weight, made of views of the layer's tensors (``None``: no 4-bit
        weight). Under FSDP2 in forward they are views of the unsharded parameters."""
        meta = self.packed_meta
        if meta is None:
            return None
        return meta.state(self._view(ABSMAX), self._view(QUANT_MAP), self._view(NESTED_OFFSET),
                          self._view(NESTED_ABSMAX), self._view(NESTED_QUANT_MAP), self.packed_dtype)

    def packed_scales(self) -> torch.Tensor | None:
        """The int8 weight's float32 row scales (``None``: no int8 weight)."""
        return self._view(SCB) if SCB in self._parameters else None

    def mirror_bitsandbytes_attributes(self) -> None:
        """Give the weight parameter bitsandbytes' attributes (views of the layer's tensors), for code that reads a
        ``Params4bit`` / ``Int8Params``; done again after every move (``to``), copy and load."""
        kind, w = self.packed_kind, self._parameters.get("weight")
        if kind is None or w is None or _is_dtensor(w):
            return
        if kind == "int8":
            w.SCB, w.CB, w.has_fp16_weights = self.packed_scales(), w.data, False
            return
        _name_state_keys(w, self.packed_quant_state())
        w.blocksize, w.quant_type = self.packed_meta.blocksize, self.packed_meta.quant_type
        w.compress_statistics, w.quant_storage, w.bnb_quantized = w.quant_state.nested, w.dtype, True

    # -- state dicts ----------------------------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """bitsandbytes' keys and values: ``weight``, ``bias``, then the quant state (4-bit: ``weight.absmax``, ...,
        ``weight.quant_state.bitsandbytes__<type>``; int8: ``SCB``, ``weight_format``). A layer released to ``meta``
        (another pipeline rank's stage) saves its weight and bias only, as bitsandbytes' layer there did."""
        if self.packed_kind is None:
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in ("weight", "bias"):
            t = self._parameters.get(name)
            if t is not None:
                destination[prefix + name] = t if keep_vars else t.detach()
        if self.weight.device.type != "meta":
            for key, value in self._quant_state_items().items():
                destination[prefix + key] = value if keep_vars else value.detach()
        return None

    def _quant_state_items(self) -> dict[str, torch.Tensor]:
        if self.packed_kind == "int8":
            return {"SCB": self.packed_scales(), "weight_format": torch.tensor(0, dtype=torch.uint8)}
        state = self.packed_quant_state()
        _name_state_keys(self.weight, state)  # torch.distributed.checkpoint resolves each key with getattr
        items = state.as_dict(packed=True)
        if state.nested:
            key = f"quant_state.bitsandbytes__{state.quant_type}"
            items[key] = _fixed_width(items[key], state.offset.item())
        return {f"weight.{k}": v for k, v in items.items()}

    def _own_entries(self, state_dict: dict, prefix: str) -> dict:
        """``state_dict`` with bitsandbytes' quant-state keys taken out and this layer's own tensors in their place
        (each copied onto itself): the load that follows finds every parameter of the layer."""
        key = prefix + "weight"
        quant_keys = {prefix + k for k in _INT8_KEYS}
        own = {k: v for k, v in state_dict.items() if not k.startswith(key + ".") and k not in quant_keys}
        own[key] = self.weight
        own.update({prefix + n: p for n, p in self._parameters.items() if n in STATE_PARAMETERS})
        return own

    # -- keeping the mirror -----------------------------------------------------------------------------------
    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.mirror_bitsandbytes_attributes()  # a move gives the tensors new storages
        return self

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.mirror_bitsandbytes_attributes()  # a copy or an unpickled layer: views of its own tensors


def _fixed_width(packed: torch.Tensor, offset: float) -> torch.Tensor:
    """bitsandbytes' packed JSON of a double-quantized state, with trailing spaces (JSON allows them) so that its
    length does not depend on the digits of the nested offset: ``torch.distributed.checkpoint`` loads a tensor only
    into one of the saved size, and the model that loads a checkpoint has an offset of its own."""
    pad = _OFFSET_WIDTH - len(json.dumps(offset))
    return torch.cat([packed, torch.full((pad,), ord(" "), dtype=packed.dtype, device=packed.device)])


def _name_state_keys(weight: torch.Tensor, state: Any) -> None:
    """The attributes bitsandbytes' ``Params4bit`` answers for its state-dict keys (``weight.absmax``, ...), on
    ``weight`` (FSDP2's ``DTensor`` parameter too): ``torch.distributed.checkpoint`` walks each key with getattr."""
    weight.quant_state, weight.absmax, weight.quant_map = state, state.absmax, state.code
    if state.nested:
        weight.nested_absmax, weight.nested_quant_map = state.state2.absmax, state.state2.code
