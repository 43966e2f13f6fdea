"""Quantize a model's Linear layers with bitsandbytes, keep only the packed weights for backward, add LoRA.

``NoSaveBitsandbytesPrecision`` is Lightning's bitsandbytes precision plugin with four changes:

- the converted layers run :func:`lightning_memkit.ops.nosave_matmul.nosave_linear`: forward keeps no
  input and no dequantized weight for backward, only the packed weight and its quant state, all through
  ``save_for_backward`` (visible to saved-tensor hooks and to ``SavedTensorProfiler``);
- it works on CPU: the layers are quantized during ``convert_module`` on the device the weights are on
  (Lightning's layers quantize only on CUDA, and ``Trainer`` refuses Lightning's plugin off CUDA);
- the converted layers are frozen (weight and bias; Lightning's 4-bit conversion freezes the bias too,
  its int8 one does not) and ``lora_rank > 0`` adds a trainable
  :class:`~lightning_memkit.ops.lora.LoRAAdapter` to each of them (QLoRA);
- a Hugging Face model becomes a QLoRA model with no further code (:mod:`lightning_memkit.hf.qlora`): its MoE
  experts' 3-D weights are quantized too, expert by expert, with per-expert adapters
  (:class:`~lightning_memkit.ops.lora.ExpertLoRAAdapter`); ``lm_head`` stays unquantized; every other
  parameter (embeddings, norms, routers, biases, ``lm_head``) is frozen and kept in the dtype it was loaded in;
- the weights are quantized as loaded, from their own dtype, and the rest kept so: the base transformers'
  ``BitsAndBytesConfig`` makes of the checkpoint loaded in that dtype, so adapters saved by peft serve as trained;
- the converted layers hold the packed weight and its quant state as plain tensors of their own
  (:mod:`~lightning_memkit.plugins.packed_state`): a converted model shards under FSDP2 (``fully_shard``) as it
  is, its state dicts in bitsandbytes' layout;
- a peft model (LoRA adapters made by ``peft.get_peft_model``) keeps its adapters: the ``base_layer`` of each
  peft LoRA layer is quantized like any other Linear layer, peft's ``lora_A``/``lora_B`` stay dense and
  trainable (float32 ones stay float32), and ``lora_rank`` must stay 0.

Example::

    from lightning import Trainer
    from lightning_memkit.plugins import NoSaveBitsandbytesPrecision

    trainer = Trainer(accelerator="cpu", plugins=[NoSaveBitsandbytesPrecision("nf4", "bfloat16", lora_rank=8)])

LightningCLI::

    trainer:
      plugins:
        - class_path: lightning_memkit.plugins.NoSaveBitsandbytesPrecision
          init_args: {mode: nf4, dtype: bfloat16, lora_rank: 8, ignore_modules: [head]}
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from lightning.fabric.plugins.precision import bitsandbytes as _fabric_bnb
from lightning.pytorch.plugins.precision.precision import Precision
from torch import nn

from lightning_memkit.common.validation import check_choice
from lightning_memkit.hf.peft_models import peft_adapter_linears, peft_problems, peft_tuner_layers
from lightning_memkit.hf.qlora import (
    check_experts,
    expert_modules,
    hf_models,
    output_embedding_names,
    prepare_experts,
)
from lightning_memkit.hf.qlora import freeze_all_but_adapters_ as freeze_base_
from lightning_memkit.measure.report import logical_numel, parameter_storage_bytes
from lightning_memkit.ops.lora import check_lora_args
from lightning_memkit.plugins.nosave_linear import NoSaveLinearMixin

__all__ = ["NoSaveBitsandbytesPrecision", "MODES"]

log = logging.getLogger(__name__)

MODES = ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8")
_ALLOWED_DTYPES = {
    **{m: (torch.bfloat16, torch.float16, torch.float32) for m in MODES if m != "int8"},
    "int8": (torch.float16,),  # Lightning's rule for int8: the quantized path is fp16
}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
# mode -> (our layer class, Lightning's layer class it extends)
_LAYERS = {
    "nf4": ("NoSaveNF4Linear", "_NF4Linear"),
    "nf4-dq": ("NoSaveNF4DQLinear", "_NF4DQLinear"),
    "fp4": ("NoSaveFP4Linear", "_FP4Linear"),
    "fp4-dq": ("NoSaveFP4DQLinear", "_FP4DQLinear"),
    "int8": ("NoSaveInt8Linear", "_Int8LinearInference"),
}


def packed_modes(state_dict: dict) -> set[str]:
    """The plugin modes (``nf4``, ``fp4-dq``, ``int8``, ...) of the packed Linear weights in ``state_dict`` (empty:
    not a converted model's state dict)."""
    modes = set()
    for key in state_dict:
        head, sep, kind = key.rpartition("weight.quant_state.bitsandbytes__")
        if sep:
            modes.add(kind + ("-dq" if f"{head}weight.nested_absmax" in state_dict else ""))
        elif key == "SCB" or key.endswith(".SCB"):
            modes.add("int8")
    return modes


# -- layer classes ---------------------------------------------------------------------------------------
class _NoSave4bitMixin(NoSaveLinearMixin):
    def quantize_packed_(self, weight: torch.Tensor, device: torch.device) -> None:
        """Lightning's steps on any device, from the weight as loaded, in its own dtype (Lightning's own quantize a
        float16 copy, on CUDA only): the packed bytes and quant state transformers' ``BitsAndBytesConfig`` makes of
        the base loaded in that dtype, so adapters saved by peft or exported meet the base they were trained on.
        The dtype is kept as ``source_dtype``, the dtype to load the base in; a later weight (a state dict's, loaded
        into the converted layer) is cast to it first, as ``load_state_dict`` casts into a parameter's dtype."""
        self.source_dtype = getattr(self, "source_dtype", None) or weight.dtype
        w = weight.contiguous().to(device=device, dtype=self.source_dtype)
        packed, quant_state = _fabric_bnb._import_bitsandbytes().functional.quantize_4bit(w, **self._packing())
        self.set_packed_4bit_(packed, quant_state)

    def _packing(self) -> dict[str, Any]:
        """bitsandbytes' 4-bit settings of this layer: Lightning's ``Params4bit``'s, then the packed weight's."""
        meta = self.packed_meta
        if meta is None:
            w = self.weight
            return {"blocksize": w.blocksize, "compress_statistics": w.compress_statistics,
                    "quant_type": w.quant_type, "quant_storage": w.quant_storage}
        return {"blocksize": meta.blocksize, "compress_statistics": meta.nested_blocksize is not None,
                "quant_type": meta.quant_type, "quant_storage": self.weight.dtype}

    def load_packed_(self, packed: torch.Tensor, state_dict: dict, prefix: str) -> None:
        key = prefix + "weight."
        stats = {k[len(key):]: v for k, v in state_dict.items() if k.startswith(key)}
        packing = self._packing()
        self.check_packed(packed, packing["quant_type"])
        if not stats:
            raise ValueError(f"{type(self).__name__}: the state dict has a packed weight {prefix}weight but no "
                             "quant state (absmax, quant_map) beside it")
        device = self.weight.device
        quant_state = _fabric_bnb._import_bitsandbytes().functional.QuantState.from_dict(stats, device=device)
        mine = (packing["quant_type"], packing["blocksize"], packing["compress_statistics"])
        theirs = (quant_state.quant_type, quant_state.blocksize, bool(quant_state.nested))
        if mine != theirs or tuple(quant_state.shape) != (self.out_features, self.in_features):
            raise ValueError(f"{type(self).__name__}: the state dict's {prefix}weight was quantized as (type, block "
                             f"size, double quantization) = {theirs} for shape {tuple(quant_state.shape)}, this "
                             f"layer as {mine} for {(self.out_features, self.in_features)}")
        self.set_packed_4bit_(packed, quant_state)


class _NoSaveInt8Mixin(NoSaveLinearMixin):
    def quantize_packed_(self, weight: torch.Tensor, device: torch.device) -> None:
        """Lightning's steps (bitsandbytes' row-wise int8 of a float16 copy), on any device (Lightning's run on CUDA
        only)."""
        b = weight.contiguous().to(device=device, dtype=torch.float16)
        cb, scb, _ = _fabric_bnb._import_bitsandbytes().functional.int8_vectorwise_quant(b)
        self.set_packed_int8_(cb, scb)

    def load_packed_(self, packed: torch.Tensor, state_dict: dict, prefix: str) -> None:
        self.check_packed(packed, "int8")
        scb = state_dict.get(prefix + "SCB")
        if scb is None or scb.shape != (self.out_features,):
            raise ValueError(f"{type(self).__name__}: the state dict's packed weight {prefix}weight needs its row "
                             f"scales {prefix}SCB of shape ({self.out_features},)")
        self.set_packed_int8_(packed, scb)


@functools.cache
def _layer_classes() -> dict[str, type]:
    """``mode -> layer class``; built once bitsandbytes is imported (Lightning builds its classes that way)."""
    _fabric_bnb._import_bitsandbytes()
    classes = {}
    for mode, (name, parent_name) in _LAYERS.items():
        parent = getattr(_fabric_bnb, parent_name)
        mixin = _NoSaveInt8Mixin if mode == "int8" else _NoSave4bitMixin
        doc = f"Lightning's ``{parent_name}`` ({mode}) whose forward keeps only the packed weight for backward."
        classes[mode] = type(name, (mixin, parent), {"__module__": __name__, "__qualname__": name, "__doc__": doc})
    globals().update({cls.__name__: cls for cls in classes.values()})
    return classes


def __getattr__(name: str) -> type:  # the layer classes resolve by name (pickling) once bitsandbytes is importable
    for layer_name, _ in _LAYERS.values():
        if name == layer_name:
            return {cls.__name__: cls for cls in _layer_classes().values()}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- argument checks -------------------------------------------------------------------------------------
def _parse_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = dtype.strip().removeprefix("torch.")
        value = getattr(torch, _DTYPE_ALIASES.get(name, name), None)
        if isinstance(value, torch.dtype):
            return value
        raise ValueError(
            f"NoSaveBitsandbytesPrecision(dtype={dtype!r}): not a torch dtype name; allowed: 'bfloat16', "
            "'float16', 'float32' (optionally prefixed with 'torch.') or a torch.dtype"
        )
    raise TypeError(
        f"NoSaveBitsandbytesPrecision(dtype=...): must be None, a str or a torch.dtype, got {type(dtype).__name__}"
    )


def _default_dtype(mode: str) -> torch.dtype:
    if mode == "int8":
        return torch.float16
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def _parse_ignore(ignore_modules: Any) -> set[str]:
    if ignore_modules is None:
        return set()
    if isinstance(ignore_modules, str) or not isinstance(ignore_modules, Iterable):
        raise TypeError(
            f"NoSaveBitsandbytesPrecision: ignore_modules must be a set or list of module names, got "
            f"{ignore_modules!r}"
        )
    names = set(ignore_modules)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise TypeError(f"NoSaveBitsandbytesPrecision: ignore_modules entries must be non-empty str, got {bad!r}")
    return names


def _linear_names(module: nn.Module) -> list[str]:
    return [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]


def _shared_linears(module: nn.Module, quantized: tuple[type, ...]) -> dict[str, list[str]]:
    """Unquantized Linear layers whose weight or bias another module also holds (a tied LM head), or that sit at two
    names: ``{name: [the other holders' parameter names]}``. Converting them would untie them (Lightning copies)."""
    holders: dict[int, list[str]] = defaultdict(list)
    mods = list(module.named_modules(remove_duplicate=False))
    for name, m in mods:
        for pname, p in m.named_parameters(recurse=False):
            holders[id(p)].append(f"{name}.{pname}" if name else pname)
    shared: dict[str, list[str]] = {}
    for name, m in mods:
        if name and isinstance(m, nn.Linear) and not isinstance(m, quantized):  # the root is never replaced
            mine = {f"{name}.weight", f"{name}.bias"}
            others = [h for p in (m.weight, m.bias) if p is not None for h in holders[id(p)] if h not in mine]
            if others:
                shared[name] = others
    return shared


@contextlib.contextmanager
def _detached(module: nn.Module, names: Iterable[str]) -> Iterator[None]:
    """Put placeholders at ``names`` for the duration (Lightning then cannot replace them); restore on exit."""
    saved = []
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        saved.append((parent, attr, parent._modules[attr]))
        parent._modules[attr] = nn.Identity()
    try:
        yield
    finally:
        for parent, attr, original in saved:
            parent._modules[attr] = original


def _on_fake_tensors(module: nn.Module) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(p, FakeTensor) for p in module.parameters())


def _warm_nested_code() -> None:
    """One real double-quantization, so that bitsandbytes builds its constant code map from real values
    (it reads them with ``tolist``, which a fake tensor cannot answer) before the fake conversion uses it."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        _fabric_bnb._import_bitsandbytes().functional.quantize_4bit(torch.ones(256, dtype=torch.float16),
                                                                    compress_statistics=True)


def _pack_layers(module: nn.Module, mode: str, dtype: torch.dtype, ignore_modules: set[str], prefix: str = "") -> None:
    """Lightning's replacement rule (every ``nn.Linear`` whose name starts with no ignored prefix), with
    :class:`~lightning_memkit.plugins.packed_linear.PackedLinear` layers."""
    from lightning_memkit.plugins.packed_linear import PackedLinear

    for name, child in module.named_children():
        fullname = f"{prefix}.{name}" if prefix else name
        if isinstance(child, nn.Linear) and not any(fullname.startswith(s) for s in ignore_modules):
            setattr(module, name, PackedLinear.from_linear(child, mode, dtype))
        else:
            _pack_layers(child, mode, dtype, ignore_modules, fullname)


@contextlib.contextmanager
def _all_or_nothing(module: nn.Module) -> Iterator[None]:
    """Undo every change to ``module``'s submodules, classes and parameters (data, ``requires_grad``) on an error."""
    saved = [(m, m.__class__, dict(m._modules), dict(m._parameters), dict(m._buffers)) for m in module.modules()]
    params = [(p, p.data, p.requires_grad) for p in module.parameters()]
    try:
        yield
    except BaseException:
        for m, cls, modules, parameters, buffers in saved:
            m.__class__ = cls
            for current, before in ((m._modules, modules), (m._parameters, parameters), (m._buffers, buffers)):
                current.clear()
                current.update(before)
        for p, data, requires_grad in params:
            p.data = data
            p.requires_grad_(requires_grad)
        raise


class NoSaveBitsandbytesPrecision(Precision, _fabric_bnb.BitsandbytesPrecision):
    """Lightning's ``BitsandbytesPrecision`` with no-save quantized matmuls, CPU support and optional QLoRA.

    Args:
        mode: ``"nf4"``, ``"nf4-dq"``, ``"fp4"``, ``"fp4-dq"`` (4-bit, ``-dq``: double-quantized absmax) or
            ``"int8"`` (LLM.int8 row-wise weights).
        dtype: compute dtype, a ``torch.dtype`` or its name (``"bfloat16"``, ``"torch.float16"``, ...).
            4-bit modes: bfloat16, float16 or float32 (default bfloat16, float16 on a CUDA GPU without
            bf16); ``int8``: float16 only (as in Lightning), and the product runs in the input's dtype.
        ignore_modules: names (prefixes) of submodules whose Linear layers stay unquantized, e.g.
            ``{"head"}``; every entry must match a Linear layer of the model at conversion.
        lora_rank: rank of the LoRA adapters added to every converted layer; 0 (default) adds none.
        lora_alpha: LoRA scaling numerator (the update is scaled by ``lora_alpha / lora_rank``).
        lora_dropout: dropout on the adapters' input.

    Conversion (``convert_module``, called by the strategy in ``setup``) reuses Lightning's layer
    replacement, then quantizes each converted layer on the device its weight is on and attaches the
    adapters. It subclasses Lightning's plugin machinery (``lightning.fabric``'s ``BitsandbytesPrecision``
    plus ``lightning.pytorch``'s ``Precision``, the same bases as ``lightning.pytorch``'s
    ``BitsandbytesPrecision``) without being an instance of the latter: ``Trainer`` rejects that class on
    anything but CUDA.

    Example::

        >>> import torch
        >>> from lightning_memkit.plugins import NoSaveBitsandbytesPrecision
        >>> plugin = NoSaveBitsandbytesPrecision("nf4", "float32", lora_rank=4)
        >>> model = plugin.convert_module(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()))
        >>> type(model[0]).__name__, model[0].weight.dtype, [n for n, p in model.named_parameters() if p.requires_grad]
        ('NoSaveNF4Linear', torch.uint8, ['0.lora.A', '0.lora.B'])
    """

    def __init__(
        self,
        mode: str,
        dtype: str | torch.dtype | None = None,
        ignore_modules: set[str] | list[str] | None = None,
        lora_rank: int = 0,
        lora_alpha: float = 16,
        lora_dropout: float = 0.0,
    ) -> None:
        check_choice(mode, "mode", MODES, owner="NoSaveBitsandbytesPrecision")
        parsed = _parse_dtype(dtype) or _default_dtype(mode)
        if parsed not in _ALLOWED_DTYPES[mode]:
            allowed = ", ".join(str(d) for d in _ALLOWED_DTYPES[mode])
            raise ValueError(
                f"NoSaveBitsandbytesPrecision: dtype={dtype!r} cannot run with mode={mode!r}; allowed: {allowed}"
            )
        ignore = _parse_ignore(ignore_modules)
        check_lora_args(lora_rank, lora_alpha, lora_dropout, owner="NoSaveBitsandbytesPrecision")
        super().__init__(mode=mode, dtype=parsed, ignore_modules=ignore)
        self._linear_cls = _layer_classes()[mode]
        self.mode = mode
        self.lora_rank = lora_rank
        self.lora_alpha = float(lora_alpha)
        self.lora_dropout = float(lora_dropout)
        #: ``(layer name, dense bytes in dtype, packed bytes with quant state)`` per Linear weight quantized
        self.quantized_weights: list[tuple[str, int, int]] = []
        #: the same per 3-D expert weight quantized (``QuantizedExperts``: every expert of one projection)
        self.quantized_experts: list[tuple[str, int, int]] = []
        self.experts_converted = 0
        self._converted: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Replace the Linear layers (Lightning's conversion), quantize them where they are, add LoRA adapters.

        Hugging Face models inside ``module`` become QLoRA models: their MoE experts are quantized too (expert
        by expert, with per-expert adapters; ``ignore_modules`` prefixes may name experts modules), their output
        embedding (``lm_head``) stays unquantized, and every parameter outside the adapters (those of ignored
        modules included) is frozen and kept in the dtype it was loaded in (``dtype`` is the quantized products'
        compute dtype), as transformers' ``BitsAndBytesConfig`` loading keeps it.

        The whole model is checked and the experts are quantized before anything changes; if a step still
        fails, every change is undone. A Linear layer whose weight or bias is shared with another module (an
        LM head tied to the embedding) stays an unquantized ``nn.Linear`` so the tie holds; an info log line
        names it.
        """
        if module in self._converted:  # converted early to load a converted state dict (see convert_on_load)
            return module
        bnb = _fabric_bnb._import_bitsandbytes()
        ours = tuple(_layer_classes().values())
        self._check_no_foreign_layers(module, bnb, ours)
        self._check_ignore_modules(module)
        adapters = self._check_peft(module)
        quantized = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
        heads = {n for n in output_embedding_names(module) if not self._ignored(n)}
        shared = {n: h for n, h in _shared_linears(module, quantized).items() if not self._ignored(n)}
        self._check_not_empty(module, {**shared, **dict.fromkeys([*heads, *adapters], [])})
        experts = [(n, m) for n, m in expert_modules(module) if not self._ignored(n)]
        self._check_experts_not_peft_wrapped(module, experts)
        for name, m in experts:
            check_experts(name, m)
        if self.mode.endswith("-dq") and _on_fake_tensors(module):
            _warm_nested_code()
        conversions = [prepare_experts(n, m, self.mode, self.dtype, self.lora_rank, self.lora_alpha,
                                       self.lora_dropout) for n, m in experts]
        for name, others in shared.items():
            if name not in heads:
                log.info("NoSaveBitsandbytesPrecision: %r stays an unquantized nn.Linear: its parameters are shared "
                         "with %s (quantizing would untie them)", name, ", ".join(others))
        with _all_or_nothing(module):
            module = self._convert_linears(module, ours, set(shared) | heads | set(adapters))
            for conversion in conversions:
                conversion.apply()
            for _, model in hf_models(module):
                freeze_base_(model)  # kept as loaded; memkit's and peft's adapters stay trainable
        self.experts_converted = len(conversions)
        self.quantized_experts = _quantized_experts(module, self.dtype)
        log.debug("NoSaveBitsandbytesPrecision: %d experts modules converted to %s", len(conversions), self.mode)
        self._converted.add(module)
        return module

    def convert_on_load(self, module: nn.Module) -> torch.utils.hooks.RemovableHandle:
        """Convert ``module`` as soon as a converted state dict (a checkpoint of a run with this plugin) is loaded
        into it, before its tensors are copied: Lightning restores a checkpoint before the plugin converts the
        model, so resuming would otherwise load packed weights into the unconverted layers. Returns the hook's
        handle; :class:`~lightning_memkit.plugins.quantized_resume.QuantizedResume` registers it for every fit.

        Example::

            >>> from torch import nn
            >>> plugin = NoSaveBitsandbytesPrecision("nf4", "float32", lora_rank=2)
            >>> saved = plugin.convert_module(nn.Sequential(nn.Linear(64, 32))).state_dict()
            >>> fresh = nn.Sequential(nn.Linear(64, 32))
            >>> handle = plugin.convert_on_load(fresh)
            >>> _ = fresh.load_state_dict(saved)  # converted first, then the packed weight restored as saved
            >>> torch.equal(fresh[0].weight, saved["0.weight"]), type(fresh[0]).__name__
            (True, 'NoSaveNF4Linear')
        """

        def convert_first(target, state_dict, *_args) -> None:
            self.convert_for(target, state_dict)

        return module.register_load_state_dict_pre_hook(convert_first)

    def convert_for(self, module: nn.Module, state_dict: Mapping[str, Any]) -> None:
        """Convert ``module`` now when ``state_dict`` is a converted model's (a checkpoint of a run with this plugin,
        in ``module``'s key space); one quantized in another mode is refused before the model changes. Anything
        else leaves ``module`` as it is (the strategies that check a checkpoint's shapes first call this)."""
        saved = packed_modes(state_dict) if module not in self._converted else set()
        if saved:
            if saved != {self.mode}:
                raise ValueError(f"NoSaveBitsandbytesPrecision(mode={self.mode!r}) cannot load a state dict "
                                 f"quantized as {', '.join(sorted(saved))}: resume with the mode it was trained with")
            self.convert_module(module)

    def _convert_linears(self, module: nn.Module, ours: tuple[type, ...], kept: set[str]) -> nn.Module:
        """Lightning's layer replacement (``kept`` layers hidden from it), then quantize, freeze, add LoRA.

        On fake tensors (an estimate) the layers are :class:`~lightning_memkit.plugins.packed_linear.PackedLinear`:
        bitsandbytes' ``Params4bit`` cannot hold a fake tensor.
        """
        from lightning_memkit.plugins.packed_linear import PackedLinear

        fake = _on_fake_tensors(module)
        if fake:
            ours = (PackedLinear,)
        hidden = [n for n, _ in module.named_modules(remove_duplicate=False)
                  if n in kept and not any(n.startswith(f"{k}.") for k in kept)]  # outermost: inner ones go along
        with _detached(module, hidden):
            if fake:
                _pack_layers(module, self.mode, self.dtype, self.ignore_modules)
            elif not kept or any(isinstance(m, nn.Linear) for m in module.modules()):  # else nothing to replace
                module = super().convert_module(module)
        layers = [m for m in module.modules() if isinstance(m, ours)]
        for layer in layers:
            if not layer.is_quantized and layer.weight.device.type != "meta":
                layer.quantize_(device=layer.weight.device)
            layer.freeze_base()
            if self.lora_rank > 0:
                layer.add_lora(self.lora_rank, self.lora_alpha, self.lora_dropout)
        log.debug("NoSaveBitsandbytesPrecision: %d Linear layers converted to %s", len(layers), self.mode)
        self.quantized_weights = [
            (name, logical_numel(m.weight) * self.dtype.itemsize, parameter_storage_bytes(m.weight))
            for name, m in module.named_modules() if isinstance(m, ours) and m.is_quantized
        ]
        return module

    def memory_effect(self) -> str:
        """One line: weight bytes saved by quantization (dense bytes in ``dtype`` minus packed ones, quant state in),
        the Linear layers' and the MoE experts'."""
        weights, experts = self.quantized_weights, self.quantized_experts
        if not weights and not experts:
            return "NoSaveBitsandbytesPrecision: no Linear layer was quantized"
        dense = sum(d for _, d, _ in (*weights, *experts))
        packed = sum(q for _, _, q in (*weights, *experts))
        what = f"{len(weights)} Linear weights" + (
            f" and {len(experts)} expert weights ({self.experts_converted} MoE experts modules)" if experts else "")
        return (f"NoSaveBitsandbytesPrecision: {what} quantized to {self.mode}: "
                f"{dense:,} bytes dense in {str(self.dtype).removeprefix('torch.')} -> {packed:,} bytes packed "
                f"(with quant state), {dense - packed:,} bytes saved")

    def _check_peft(self, module: nn.Module) -> list[str]:
        """A peft model: no ``lora_rank`` of ours on top of its adapters, nothing a quantized base cannot run.
        Returns the names of peft's adapter Linear layers (they stay dense)."""
        layers = peft_tuner_layers(module)
        if not layers:
            return []
        if self.lora_rank > 0:
            names = sorted({a for _, m in layers for key in ("lora_A", "lora_embedding_A")
                            for a in (getattr(m, key, None) or {})})
            raise ValueError(
                f"NoSaveBitsandbytesPrecision: lora_rank={self.lora_rank} adds LoRA adapters of its own, but the "
                f"model already has peft adapters ({', '.join(map(repr, names)) or 'peft tuner layers'} on "
                f"{len(layers)} layers, e.g. {layers[0][0]!r}); allowed: lora_rank=0 with a peft model (its adapters "
                "train), or lora_rank > 0 on the model without peft"
            )
        problems = peft_problems(module)
        if problems:
            raise ValueError(f"NoSaveBitsandbytesPrecision: the peft model cannot run on quantized base layers: "
                             f"{'; '.join(problems)}; allowed: plain LoRA adapters (peft's lora.Linear)")
        return peft_adapter_linears(module)

    @staticmethod
    def _check_experts_not_peft_wrapped(module: nn.Module, experts: list[tuple[str, nn.Module]]) -> None:
        """peft's ``target_parameters`` adapters (``lora.ParamWrapper``) add their delta to the experts' 3-D weights:
        those weights cannot be quantized."""
        tuners = [n for n, _ in peft_tuner_layers(module)]
        wrapped = [name for name, _ in experts if any(name.startswith(f"{n}.") for n in tuners)]
        if wrapped:
            outer = sorted(min((n for n in tuners if w.startswith(f"{n}.")), key=len) for w in wrapped)
            raise ValueError(
                f"NoSaveBitsandbytesPrecision: MoE experts modules {', '.join(map(repr, outer))} carry peft adapters "
                "on their 3-D weights (LoraConfig(target_parameters=...)), which peft adds to the weights "
                "themselves, so those weights cannot be quantized; allowed: list them in ignore_modules (they stay "
                "unquantized, frozen, in dtype; peft's adapters train), or put the adapters on the experts with "
                "lora_rank on the model without peft"
            )

    @staticmethod
    def _check_no_foreign_layers(module: nn.Module, bnb: Any, ours: tuple[type, ...]) -> None:
        foreign = [n for n, m in module.named_modules()
                   if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) and not isinstance(m, ours)]
        if foreign:
            raise ValueError(
                "NoSaveBitsandbytesPrecision: the module already holds bitsandbytes layers that this plugin did not "
                f"create ({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}); pass the unquantized model"
            )

    def _ignored(self, name: str) -> bool:
        return any(name.startswith(s) for s in self.ignore_modules)  # Lightning's rule: name prefixes

    def _check_not_empty(self, module: nn.Module, shared: dict[str, list[str]]) -> None:
        """Every Linear layer that would be quantized has a weight with elements (bitsandbytes divides by it)."""
        bnb = _fabric_bnb._import_bitsandbytes()
        if any(isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) for m in module.modules()):
            return  # already converted: Lightning replaces nothing more
        empty = [f"{n!r} (in_features={m.in_features}, out_features={m.out_features})"
                 for n, m in module.named_modules()
                 if isinstance(m, nn.Linear) and m.weight.numel() == 0 and n not in shared and not self._ignored(n)]
        if empty:
            raise ValueError(
                f"NoSaveBitsandbytesPrecision: Linear layer(s) {', '.join(empty)} of {type(module).__name__} have no "
                "weights, which bitsandbytes cannot quantize; remove them or list them in ignore_modules"
            )

    def _check_ignore_modules(self, module: nn.Module) -> None:
        if not self.ignore_modules:
            return
        names = _linear_names(module)
        experts = [n for n, _ in expert_modules(module, include_converted=True)]
        unmatched = sorted(s for s in self.ignore_modules if not any(n.startswith(s) for n in names + experts))
        if unmatched:
            shown = ", ".join(repr(n) for n in names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
            what, moe = "Linear layer", ""
            if experts:
                what = "Linear layer or MoE experts module"
                moe = f"; MoE experts modules: {', '.join(map(repr, experts))}"
            raise ValueError(
                f"NoSaveBitsandbytesPrecision: ignore_modules entries {unmatched} match no {what} of "
                f"{type(module).__name__} (they are name prefixes); Linear layers: {shown or 'none'}{moe}"
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(mode={self.mode!r}, dtype={self.dtype}, "
            f"ignore_modules={sorted(self.ignore_modules)}, lora_rank={self.lora_rank}, "
            f"lora_alpha={self.lora_alpha:g}, lora_dropout={self.lora_dropout:g})"
        )


def _quantized_experts(module: nn.Module, dtype: torch.dtype) -> list[tuple[str, int, int]]:
    """``(name, dense bytes in dtype, packed bytes with quant state)`` of each quantized 3-D expert weight."""
    from lightning_memkit.ops.nosave_experts import QuantizedExperts

    return [(name, m.num_experts * m.in_features * m.out_features * dtype.itemsize,
             sum(t.nbytes for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))))
            for name, m in module.named_modules() if isinstance(m, QuantizedExperts)]
