"""QLoRA on Hugging Face models: which modules are heads and experts, and MoE experts that run quantized + LoRA.

transformers (5.x) keeps the experts of an MoE layer as 3-D parameters of one module whose class is
decorated with ``use_experts_implementation``; the decorator records the layout on the instance:
``has_gate`` (a fused ``gate_up_proj`` or a plain ``up_proj``), ``has_bias`` (``<projection>_bias``, one row
per expert), ``is_transposed`` (``(E, in, out)`` as GPT-OSS stores them, else ``(E, out, in)`` as Qwen3-MoE
does) and ``has_post_expert_norm``; the gating is the module's own ``_apply_gate`` (GPT-OSS: a clamped swiglu
over interleaved gate/up columns with ``alpha`` and ``limit``; Qwen3-MoE: ``act_fn(gate) * up``).

:func:`prepare_experts` quantizes such a module's 3-D weights expert by expert into
:class:`~lightning_memkit.ops.nosave_experts.QuantizedExperts` (same attribute names) and builds one
:class:`~lightning_memkit.ops.lora.ExpertLoRAAdapter` per projection, without touching the module;
:meth:`ExpertConversion.apply` installs them and switches the module to a subclass of its own class whose
forward routes the tokens as transformers' eager forward does (the tokens of each hit expert, weighted by
the router's scores, added with ``index_add_``) and computes each projection with the no-save quantized
matmul plus the expert's adapter, calling the module's own ``_apply_gate`` (or ``act_fn``) and biases.
transformers is imported only if it is already imported (a model holding its modules has imported it).

Example::

    >>> import torch
    >>> from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
    >>> from lightning_memkit.hf.qlora import expert_modules, prepare_experts
    >>> model = tiny_hf_causal_lm("gpt_oss", seed=0)
    >>> [name for name, _ in expert_modules(model)]
    ['model.layers.0.mlp.experts', 'model.layers.1.mlp.experts']
    >>> name, experts = expert_modules(model)[0]
    >>> prepare_experts(name, experts, "nf4", torch.float32, lora_rank=4).apply()
    >>> type(experts).__name__, experts.gate_up_proj.weight.dtype, tuple(experts.lora.gate_up_proj.A.shape)
    ('QLoRAGptOssExperts', torch.uint8, (4, 64, 4))
    >>> ids = torch.randint(0, 256, (1, 8))
    >>> model(input_ids=ids, labels=ids).loss.backward()
    >>> experts.lora.gate_up_proj.A.grad is None, experts.lora.gate_up_proj.B.grad.shape  # B starts at zero
    (False, torch.Size([4, 4, 256]))
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_memkit.hf.peft_models import peft_adapter_parameters
from lightning_memkit.ops.lora import ExpertLoRAAdapter, LoRAAdapter
from lightning_memkit.ops.nosave_experts import QuantizedExperts, check_expert_weight

__all__ = [
    "hf_models",
    "output_embedding_names",
    "expert_modules",
    "expert_projections",
    "check_experts",
    "prepare_experts",
    "ExpertConversion",
    "QLoRAExperts",
    "dequantized_experts",
    "freeze_all_but_adapters_",
]

_LAYOUT_ATTRS = ("has_gate", "has_bias", "is_transposed")


# -- finding things --------------------------------------------------------------------------------------
def hf_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, model)`` of every outermost ``transformers.PreTrainedModel`` in ``module`` (itself included)."""
    if "transformers" not in sys.modules:
        return []
    from transformers import PreTrainedModel

    found: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        if isinstance(m, PreTrainedModel) and not any(name.startswith(f"{outer}.") or not outer for outer, _ in found):
            found.append((name, m))
    return found


def output_embedding_names(module: nn.Module) -> list[str]:
    """Names (in ``module``) of the output embeddings (``lm_head``) of the Hugging Face models in ``module``."""
    heads = {id(head) for _, model in hf_models(module) if (head := model.get_output_embeddings()) is not None}
    return [name for name, m in module.named_modules(remove_duplicate=False) if id(m) in heads]


def _is_experts(m: nn.Module) -> bool:
    """A transformers experts module (the layout attributes its decorator sets), not converted yet."""
    return (not isinstance(m, QLoRAExperts) and all(isinstance(getattr(m, a, None), bool) for a in _LAYOUT_ATTRS)
            and isinstance(m._parameters.get("down_proj"), torch.Tensor))


def expert_modules(module: nn.Module, include_converted: bool = False) -> list[tuple[str, nn.Module]]:
    """``(name, experts)`` of every unconverted transformers MoE experts module in ``module`` (and converted ones
    too with ``include_converted``)."""
    return [(name, m) for name, m in module.named_modules()
            if _is_experts(m) or (include_converted and isinstance(m, QLoRAExperts))]


def expert_projections(experts: nn.Module) -> tuple[str, ...]:
    """The 3-D weight names of an experts module: ``("gate_up_proj", "down_proj")`` or ``("up_proj", "down_proj")``."""
    return ("gate_up_proj" if experts.has_gate else "up_proj", "down_proj")


# -- checks ----------------------------------------------------------------------------------------------
def _label(name: str, experts: nn.Module) -> str:
    return f"experts module {name!r} ({type(experts).__name__})"


def check_experts(name: str, experts: nn.Module) -> None:
    """Raise ``ValueError`` naming the module when ``experts`` cannot be quantized as this module does it."""
    label = _label(name, experts)
    if getattr(experts, "_is_expert_parallel", False):
        raise ValueError(f"{label} is expert-parallel (sharded, with sentinel routes); quantize it before sharding")
    num = getattr(experts, "num_experts", None)
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(f"{label}: num_experts={num!r}; expected an int >= 1")
    if getattr(experts, "has_post_expert_norm", False) and not isinstance(getattr(experts, "post_expert_norm", None),
                                                                         nn.Module):
        raise ValueError(f"{label}: has_post_expert_norm is set but it has no post_expert_norm module")
    for proj in expert_projections(experts):
        _check_projection(label, experts, proj, num)


def _check_projection(label: str, experts: nn.Module, proj: str, num: int) -> None:
    weight = experts._parameters.get(proj)
    if weight is None:
        raise ValueError(f"{label} has no 3-D parameter {proj!r}; parameters: {sorted(experts._parameters)}")
    try:
        check_expert_weight(weight, proj)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{label}: {err}") from None
    if weight.shape[0] != num:
        raise ValueError(f"{label}: {proj} has {weight.shape[0]} experts in dimension 0, num_experts={num}")
    if experts.has_bias:
        out = weight.shape[2] if experts.is_transposed else weight.shape[1]
        bias = experts._parameters.get(f"{proj}_bias")
        if bias is None or tuple(bias.shape) != (num, out):
            raise ValueError(f"{label}: has_bias is set; expected {proj}_bias of shape {(num, out)}, got "
                             f"{None if bias is None else tuple(bias.shape)}")


# -- conversion ------------------------------------------------------------------------------------------
@dataclass
class ExpertConversion:
    """The quantized weights and adapters for one experts module, built but not installed."""

    name: str
    module: nn.Module
    weights: dict[str, QuantizedExperts]
    loras: dict[str, ExpertLoRAAdapter] = field(default_factory=dict)

    def apply(self) -> None:
        """Install the weights (replacing the 3-D parameters) and adapters; switch the module's class."""
        m = self.module
        for proj, quantized in self.weights.items():
            del m._parameters[proj]
            setattr(m, proj, quantized)
        if self.loras:
            m.lora = nn.ModuleDict(self.loras)
        m.__class__ = _qlora_class(type(m))


def prepare_experts(name: str, experts: nn.Module, mode: str, dtype: torch.dtype, lora_rank: int = 0,
                    lora_alpha: float = 16, lora_dropout: float = 0.0, blocksize: int = 64) -> ExpertConversion:
    """Check ``experts``, quantize its 3-D weights (``mode``, products in ``dtype``) and build rank-``lora_rank``
    adapters (none for 0). ``experts`` itself is not changed until :meth:`ExpertConversion.apply`."""
    check_experts(name, experts)
    weights = {
        proj: QuantizedExperts.from_weight(experts._parameters[proj], mode, transposed=experts.is_transposed,
                                           compute_dtype=dtype, blocksize=blocksize)
        for proj in expert_projections(experts)
    }
    loras = {}
    if lora_rank > 0:
        loras = {proj: ExpertLoRAAdapter(q.num_experts, q.in_features, q.out_features, lora_rank, lora_alpha,
                                         lora_dropout, device=q.weight.device) for proj, q in weights.items()}
    return ExpertConversion(name, experts, weights, loras)


_CLASSES: dict[type, type] = {}


def _qlora_class(base: type) -> type:
    """``QLoRA<Base>``: ``base`` with :class:`QLoRAExperts`'s forward (one class per base, created once)."""
    if isinstance(base, type) and issubclass(base, QLoRAExperts):
        return base
    if base not in _CLASSES:
        name = f"QLoRA{base.__name__}"
        _CLASSES[base] = type(name, (QLoRAExperts, base), {"__module__": __name__, "__qualname__": name,
                                                           "_memkit_base": base})
    return _CLASSES[base]


def _rebuild(base: type) -> nn.Module:
    cls = _qlora_class(base)
    return cls.__new__(cls)


class QLoRAExperts(nn.Module):
    """Forward of a converted transformers experts module: quantized projections + per-expert LoRA.

    Mixed in before the module's own class (``QLoRA<Class>``), so the module keeps its attributes and its
    ``_apply_gate``/``act_fn``; the 3-D weights are :class:`QuantizedExperts` and the adapters sit in ``lora``.
    """

    _memkit_base: type = nn.Module

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """``(tokens, hidden)`` -> ``(tokens, hidden)``: each token's experts, weighted by its router scores."""
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
        for e in hit:
            if e == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[e])
            h = self._expert(hidden_states[token_idx], e)
            h = h * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        first, down = expert_projections(self)
        h = self._project(first, x, e)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = self._project(down, h, e)
        return self.post_expert_norm(h) if getattr(self, "has_post_expert_norm", False) else h

    def _project(self, proj: str, x: torch.Tensor, e: int) -> torch.Tensor:
        bias = self._parameters[f"{proj}_bias"][e] if self.has_bias else None
        y = self._modules[proj](x, e, bias)
        lora = self._modules.get("lora")
        return y if lora is None else y + lora[proj](x, e)

    def __reduce_ex__(self, protocol):  # the class is made at run time: rebuild it from the transformers class
        return _rebuild, (self._memkit_base,), self.__dict__.copy()


def dequantized_experts(experts: nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Dense copies of a converted module's expert weights in transformers' layout: ``{projection: (E, ., .)}``."""
    if not isinstance(experts, QLoRAExperts):
        raise TypeError(f"experts must be a converted experts module (QLoRA...), got {type(experts).__name__}")
    dense = {proj: experts._modules[proj].dequantize(None, dtype) for proj in expert_projections(experts)}
    return {k: v.transpose(1, 2).contiguous() if experts.is_transposed else v for k, v in dense.items()}


def freeze_all_but_adapters_(model: nn.Module, dtype: torch.dtype | None = None) -> list[str]:
    """Freeze every parameter of ``model`` but the LoRA adapters and cast the floating ones to ``dtype`` (``None``:
    each keeps the dtype it was loaded in, as transformers' ``BitsAndBytesConfig`` keeps the layers it does not
    quantize).

    The adapters are memkit's (:class:`~lightning_memkit.ops.lora.LoRAAdapter` and kin: left as they are, float32)
    and peft's (``lora_A``/``lora_B`` of every adapter name, ``modules_to_save`` copies): their ``requires_grad``
    stays as peft set it (the active adapters train); float32 ones stay float32 (peft keeps adapters in float32
    beside a half-precision base), others are cast to ``dtype``. Casting keeps each ``Parameter`` object.
    Returns the names of the parameters frozen.

    Example::

        >>> import torch
        >>> from peft import LoraConfig, get_peft_model
        >>> from lightning_memkit.hf.qlora import freeze_all_but_adapters_
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        >>> net = get_peft_model(net, LoraConfig(r=2, target_modules=["0"]))
        >>> [n.removeprefix("base_model.model.") for n in freeze_all_but_adapters_(net, torch.bfloat16)]
        ['0.base_layer.weight', '0.base_layer.bias', '1.weight', '1.bias']
        >>> sorted({(p.dtype, p.requires_grad) for n, p in net.named_parameters() if "lora_" in n})
        [(torch.float32, True)]
    """
    ours = {id(p) for m in model.modules() if isinstance(m, (LoRAAdapter, ExpertLoRAAdapter)) for p in m.parameters()}
    peft = peft_adapter_parameters(model)
    frozen = []
    for name, p in model.named_parameters():
        if id(p) in ours:
            continue
        if id(p) in peft:
            if dtype is not None and p.is_floating_point() and p.dtype not in (torch.float32, dtype):
                p.data = p.data.to(dtype)
            continue
        p.requires_grad_(False)
        if dtype is not None and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
        frozen.append(name)
    return frozen
