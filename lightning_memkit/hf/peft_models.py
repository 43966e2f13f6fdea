"""peft's wrappers around a transformers model: the model inside, the LoRA layers, the adapters, the head's parts.

A ``peft.PeftModel`` holds its tuner (``LoraModel``), which holds the transformers model; LoRA replaces each
targeted ``nn.Linear`` by a ``lora.Linear`` whose ``base_layer`` is the original layer and whose ``lora_A`` /
``lora_B`` (one entry per adapter name) are small ``nn.Linear`` layers; ``modules_to_save`` wraps a module in a
``ModulesToSaveWrapper`` holding a trainable copy per adapter; ``target_parameters`` (MoE experts) wraps the
module in a ``lora.ParamWrapper``. Everything here looks at peft only if it is already imported (a model that
holds peft modules has imported it), so a model without any costs nothing.

Example::

    >>> import torch
    >>> from peft import LoraConfig, get_peft_model
    >>> from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
    >>> from lightning_memkit.hf.peft_models import head_parts, peft_adapter_parameters, unwrap_peft
    >>> peft_model = get_peft_model(tiny_hf_causal_lm("llama", num_layers=1),
    ...                             LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    >>> lm = unwrap_peft(peft_model)
    >>> type(lm).__name__
    'LlamaForCausalLM'
    >>> sorted(peft_adapter_parameters(lm).values())[:2]
    ['lm_head.lora_A.default.weight', 'lm_head.lora_B.default.weight']
    >>> parts = head_parts(lm.lm_head)
    >>> tuple(parts.weight.shape), [(tuple(a.A.weight.shape), a.scaling) for a in parts.adapters]
    ((256, 64), [((4, 64), 2.0)])
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "HeadAdapter",
    "HeadParts",
    "head_parts",
    "is_peft_wrapper",
    "peft_adapter_linears",
    "peft_adapter_parameters",
    "peft_problems",
    "peft_tuner_layers",
    "unwrap_peft",
]


def _peft() -> Any:
    return sys.modules.get("peft")


def is_peft_wrapper(module: Any) -> bool:
    """``module`` is one of peft's model wrappers (``PeftModel``, ``PeftMixedModel`` or a tuner such as
    ``LoraModel``), which hold the user's model inside."""
    if _peft() is None:
        return False
    from peft import PeftMixedModel, PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    return isinstance(module, (PeftModel, PeftMixedModel, BaseTuner))


def unwrap_peft(module: Any) -> Any:
    """The model inside peft's wrappers (``PeftModel.base_model.model``), or ``module`` itself if it is none."""
    while is_peft_wrapper(module):
        from peft import PeftMixedModel, PeftModel

        # PeftModel -> its tuner (LoraModel; the model itself for prompt learning); a tuner -> the model
        module = module.base_model if isinstance(module, (PeftModel, PeftMixedModel)) else module.model
    return module


def _tuner_layer_class() -> type | None:
    if _peft() is None:
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer

    return BaseTunerLayer


def peft_tuner_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of every peft tuner layer (``lora.Linear``, ``lora.ParamWrapper``, ...) in ``module``."""
    base = _tuner_layer_class()
    if base is None:
        return []
    return [(name, m) for name, m in module.named_modules() if isinstance(m, base)]


def _adapter_containers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, container)`` of every submodule that holds peft adapter weights: a tuner layer's
    ``adapter_layer_names`` (``lora_A``, ``lora_B``, ...) and a ``ModulesToSaveWrapper``'s trainable copies."""
    found = []
    for name, layer in peft_tuner_layers(module):
        for attr in getattr(layer, "adapter_layer_names", ()):
            sub = getattr(layer, attr, None)
            if isinstance(sub, nn.Module):
                found.append((f"{name}.{attr}" if name else attr, sub))
    if _peft() is not None:
        from peft.utils.other import ModulesToSaveWrapper

        found += [(f"{n}.modules_to_save" if n else "modules_to_save", m.modules_to_save)
                  for n, m in module.named_modules() if isinstance(m, ModulesToSaveWrapper)]
    return found


def peft_adapter_parameters(module: nn.Module) -> dict[int, str]:
    """``{id(parameter): name}`` of every peft adapter parameter in ``module`` (LoRA ``A``/``B`` of every adapter,
    active or not, and ``modules_to_save`` copies); empty for a model without peft layers."""
    found: dict[int, str] = {}
    for prefix, container in _adapter_containers(module):
        for name, p in container.named_parameters():
            found.setdefault(id(p), f"{prefix}.{name}")
    return found


def peft_adapter_linears(module: nn.Module) -> list[str]:
    """Names (in ``module``) of the ``nn.Linear`` layers that are peft adapters (``lora_A``/``lora_B`` entries,
    ``modules_to_save`` copies): trainable weights that must stay dense."""
    names = []
    for prefix, container in _adapter_containers(module):
        names += [f"{prefix}.{n}" if n else prefix for n, m in container.named_modules() if isinstance(m, nn.Linear)]
    return names


def peft_problems(module: nn.Module) -> list[str]:
    """What in ``module``'s peft layers a quantized base cannot run: tuner layers other than LoRA around an
    ``nn.Linear`` (they read the base weight), LoRA variants (DoRA, ...) and merged adapters (their delta is in the
    base weight). Empty when there is none."""
    problems = []
    if _peft() is None:
        return problems
    from peft.tuners.lora import LoraLayer

    for name, layer in peft_tuner_layers(module):
        base = getattr(layer, "base_layer", None)
        if not isinstance(layer, LoraLayer):
            if isinstance(base, nn.Linear):
                problems.append(f"{name!r} is a peft {type(layer).__name__} (not LoRA): it reads its base weight")
            continue
        variants = sorted(getattr(layer, "lora_variant", {}) or {})
        if variants:
            problems.append(f"{name!r} has LoRA variant adapters {variants} (DoRA and kin read the base weight)")
        if getattr(layer, "merged_adapters", None):
            problems.append(f"{name!r} has merged adapters {list(layer.merged_adapters)}: unmerge them first")
    return problems


# -- the output head -------------------------------------------------------------------------------------------------
@dataclass
class HeadAdapter:
    """One active LoRA adapter on a head: its output is ``scaling * B(A(dropout(x)))``."""

    name: str
    A: nn.Linear
    B: nn.Linear
    dropout: nn.Module
    scaling: float


@dataclass
class HeadParts:
    """What a (possibly peft-wrapped) head computes: ``x @ weight.T + bias`` plus each adapter's output."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    adapters: list[HeadAdapter] = field(default_factory=list)
    cast_input: bool = True  # peft casts the input to the adapter's dtype


def head_parts(head: nn.Module) -> HeadParts:
    """The weight, bias and active LoRA adapters of an output head: an ``nn.Linear``, a peft ``lora.Linear`` around
    one, or a ``ModulesToSaveWrapper`` (its active copy) of either, as peft's forward would run it now.

    Raises ``TypeError`` for any other head, and ``ValueError`` for LoRA adapters it cannot express as
    ``scaling * B(A(dropout(x)))`` (LoRA variants such as DoRA, ``fan_in_fan_out``).
    """
    if isinstance(head, nn.Linear):
        return HeadParts(head.weight, head.bias)
    peft = _peft()
    if peft is not None:
        from peft.tuners.lora import Linear as LoraLinear
        from peft.utils.other import ModulesToSaveWrapper

        if isinstance(head, ModulesToSaveWrapper):
            active = head.active_adapters
            if head.disable_adapters or not active or any(a not in head.modules_to_save for a in active):
                return head_parts(head.original_module)
            return head_parts(head.modules_to_save[active[0]])
        if isinstance(head, LoraLinear):
            return _lora_head_parts(head)
    raise TypeError(f"the output head is a {type(head).__module__}.{type(head).__name__}; allowed: nn.Linear, "
                    "peft's lora.Linear around one, or a peft ModulesToSaveWrapper of either")


def _lora_head_parts(head: nn.Module) -> HeadParts:
    base = head.get_base_layer()
    if not isinstance(base, nn.Linear):
        raise TypeError(f"the output head is a peft lora.Linear around a {type(base).__name__}; allowed: nn.Linear")
    parts = HeadParts(base.weight, base.bias, cast_input=bool(getattr(head, "cast_input_dtype_enabled", True)))
    if head.disable_adapters or head.merged:  # merged: the adapters' delta is in the base weight already
        return parts
    if getattr(head, "fan_in_fan_out", False):
        raise ValueError("the output head's LoRA has fan_in_fan_out=True (a transposed base weight); allowed: False")
    variants = [a for a in head.active_adapters if a in getattr(head, "lora_variant", {})]
    if variants:
        raise ValueError(f"the output head's LoRA adapters {variants} are LoRA variants (DoRA and kin), whose output "
                         "is not scaling * B(A(dropout(x))); allowed: plain LoRA adapters")
    for name in head.active_adapters:
        if name in head.lora_A:
            parts.adapters.append(HeadAdapter(name, head.lora_A[name], head.lora_B[name], head.lora_dropout[name],
                                              float(head.scaling[name])))
    return parts
