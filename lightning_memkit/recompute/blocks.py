"""Which blocks of a model a per-block feature (recompute, activation offload) wraps: by policy or ``"auto"``.

:func:`choose_blocks` is the one block chooser of the callbacks that wrap a model's repeated blocks. ``"auto"``
asks the given finders in turn (the callbacks pass Hugging Face decoder layers first, then
:func:`~lightning_memkit.recompute.activation_recompute.repeated_blocks`); any other policy goes to
:func:`~lightning_memkit.recompute.activation_recompute.select_modules`. A chosen FSDP1 unit or ``torch.compile``
wrapper stands for the module it wraps; a chosen block that already recomputes itself (Hugging Face gradient
checkpointing, torch's ``checkpoint_wrapper``) or that contains an FSDP unit is refused. Names come back without
the wrappers' parts (``blocks.0``, also under FSDP).

Example::

    >>> from torch import nn
    >>> net = nn.Module()
    >>> net.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    >>> [name for name, _ in choose_blocks(net, "auto", owner="MyFeature")]
    ['blocks.0', 'blocks.1']
    >>> choose_blocks(nn.Linear(2, 2), "auto", owner="MyFeature", verb="wrap")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: MyFeature(policy='auto') found in Linear neither Hugging Face decoder layers ... classes to wrap
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_memkit.recompute.activation_recompute import PolicyLike, repeated_blocks, select_modules

__all__ = ["AUTO", "choose_blocks", "clean_name"]

AUTO = "auto"
_WRAPPER_NAMES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
Finder = Callable[[nn.Module], list[tuple[str, nn.Module]]]


def clean_name(name: str) -> str:
    """``blocks.0._fsdp_wrapped_module`` -> ``blocks.0``: the name the module has without the FSDP1 wrappers."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


def _unwrap_compiled(name: str, module: nn.Module) -> tuple[str, nn.Module]:
    """A ``torch.compile``d module stands for the module it compiles: the feature is traced inside its graph."""
    from torch._dynamo.eval_frame import OptimizedModule

    while isinstance(module, OptimizedModule):
        name, module = f"{name}._orig_mod" if name else "_orig_mod", module._orig_mod
    return name, module


def _unit_kinds() -> tuple[type, ...]:
    """The module classes that make an FSDP unit: FSDP1 ``FullyShardedDataParallel`` and FSDP2 ``FSDPModule``."""
    if not torch.distributed.is_available():
        return ()
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return (FullyShardedDataParallel, FSDPModule)


def _unwrap_fsdp(name: str, module: nn.Module) -> tuple[str, nn.Module]:
    """An FSDP1 unit stands for the module it wraps: the feature runs inside it, after its parameters are gathered."""
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel

        while isinstance(module, FullyShardedDataParallel):
            name, module = f"{name}._fsdp_wrapped_module" if name else "_fsdp_wrapped_module", module.module
    return name, module


def _self_recomputing(model: nn.Module) -> list[str]:
    """Names of the modules wrapped in torch's ``CheckpointWrapper`` (``FSDPStrategy(activation_checkpointing_
    policy=...)``, ``apply_activation_checkpointing`` or ``checkpoint_wrapper`` in ``configure_model``)."""
    if not torch.distributed.is_available():
        return []
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return [name for name, m in model.named_modules() if isinstance(m, CheckpointWrapper)]


def _related(a: str, b: str) -> bool:
    """Whether module ``a`` is ``b``, inside it or around it (qualified names; ``""`` is the root)."""
    return a == b or not a or not b or a.startswith(b + ".") or b.startswith(a + ".")


def _auto(model: nn.Module, finders: Sequence[Finder], owner: str, verb: str) -> list[tuple[str, nn.Module]]:
    for find in finders:
        chosen = find(model)
        if chosen:
            return chosen
    raise ValueError(
        f"{owner}(policy='auto') found in {type(model).__name__} neither Hugging Face decoder layers (transformers "
        "GradientCheckpointingLayer) nor an nn.ModuleList of same-class blocks; pass policy= with the module "
        f"classes to {verb}"
    )


def _check_own_recompute(model: nn.Module, chosen: list[tuple[str, nn.Module]], owner: str) -> None:
    wrapped = _self_recomputing(model)
    own = [clean_name(name) for name, m in chosen if getattr(m, "gradient_checkpointing", False) is True
           or any(_related(name, w) for w in wrapped)]
    if own:
        raise ValueError(
            f"{len(own)} chosen layers ({', '.join(own[:3])}{', ...' if len(own) > 3 else ''}) already recompute "
            "themselves (Hugging Face activation_checkpointing_enable() or gradient_checkpointing_enable(), or "
            "torch's checkpoint_wrapper: FSDPStrategy(activation_checkpointing_policy=...), "
            "apply_activation_checkpointing in configure_model); call model.activation_checkpointing_disable() "
            f"(Hugging Face), drop the wrapper or policy, or remove {owner}"
        )


def _check_units(chosen: list[tuple[str, nn.Module]], owner: str, verb: str) -> None:
    """Refuse a chosen module that holds an FSDP unit: the feature must run inside the units, not around them."""
    kinds = _unit_kinds()
    if not kinds:
        return
    for name, module in chosen:
        inner = next((sub for sub, m in module.named_modules() if sub and isinstance(m, kinds)), None)
        if inner is not None:
            raise ValueError(
                f"{owner} would {verb} {clean_name(name) or 'the whole model'} ({type(module).__name__}), which "
                f"contains the FSDP unit {clean_name(inner)}: {verb} must run inside FSDP units, after they have "
                "gathered their weights. Pass policy= with the classes of the sharded blocks or of modules inside them"
            )


def choose_blocks(
    model: nn.Module, policy: PolicyLike, *, owner: str, verb: str = "recompute",
    finders: Sequence[Finder] = (repeated_blocks,),
) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the blocks ``policy`` picks in ``model``; raises ``ValueError`` when nothing matches or
    when a chosen block recomputes itself or holds an FSDP unit (messages name ``owner`` and ``verb``).

    ``policy``: ``"auto"`` (the first non-empty answer of ``finders``), module classes / class paths, or a callable
    ``(name, module) -> bool`` (:func:`~lightning_memkit.recompute.activation_recompute.select_modules`).
    """
    if policy != AUTO:
        chosen = select_modules(model, policy)  # raises, listing the classes, when nothing matches
    else:
        chosen = _auto(model, finders, owner, verb)
    chosen = [_unwrap_compiled(*_unwrap_fsdp(name, m)) for name, m in chosen]
    _check_own_recompute(model, chosen, owner)
    _check_units(chosen, owner, verb)
    return [(clean_name(name), m) for name, m in chosen]
