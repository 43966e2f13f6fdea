"""Recompute chosen submodules in backward instead of keeping their activations (activation checkpointing).

:func:`checkpoint_modules` patches the ``forward`` of each chosen submodule (an instance attribute, so
the module tree, parameter names and ``state_dict`` keys stay exactly as they were) with a wrapper that
runs the original ``forward`` under non-reentrant :func:`torch.utils.checkpoint.checkpoint`: only the
inputs are kept, the rest is rebuilt during backward. Forward hooks still run once, outside the
recomputed region. Without grad mode (validation, ``no_grad``) the wrapper calls ``forward`` directly.
The returned handle restores every patched ``forward`` (also as a context manager, exceptions included)
and holds the modules weakly.

Two recompute modes, per module: ``"full"`` keeps only the module's inputs and reruns its whole forward in
backward; ``"selective"`` (selective activation checkpointing, torch's
:func:`~torch.utils.checkpoint.create_selective_checkpoint_contexts`) also keeps the outputs of the
compute-bound ops listed in :data:`SAVED_OPS` (matmuls, attention kernels, convolutions) and reruns only the
cheap rest (norms, activations, elementwise, views), so backward never redoes a matmul. Selective saves
less than no recomputation and more than full recomputation; gradients are the same in all three. Both
modes trace under ``torch.compile``.

Example::

    >>> import torch
    >>> from lightning_memkit.memory import checkpoint_modules, select_modules
    >>> net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(3)])
    >>> chosen = select_modules(net, lambda name, m: name in ("0", "1"))
    >>> with checkpoint_modules(chosen) as handle:
    ...     net(torch.randn(4, 8, requires_grad=True)).sum().backward()
    ...     handle.names
    ['0', '1']
    >>> "forward" in vars(net[0])   # restored
    False
    >>> with checkpoint_modules(chosen, mode={"0": "selective", "1": "full"}):
    ...     [recompute_mode(m) for m in net]
    ['selective', 'full', None]
"""

from __future__ import annotations

import functools
import importlib
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Union

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = [
    "PolicyLike",
    "resolve_policy",
    "describe_policy",
    "select_modules",
    "repeated_blocks",
    "checkpoint_modules",
    "RecomputeHandle",
    "is_checkpointed",
    "recompute_mode",
    "RECOMPUTE_MODES",
    "SAVED_OPS",
    "selective_policy",
    "ModeLike",
]

PolicyLike = Union[type, str, Iterable[Union[type, str]], Callable[[str, nn.Module], bool]]  # noqa: UP007
ModeLike = Union[str, Mapping[str, str]]  # noqa: UP007
_MARK = "_memkit_recompute"
RECOMPUTE_MODES = ("full", "selective")


def _saved_ops() -> frozenset:
    """The compute-bound ATen ops whose outputs selective recompute keeps (those this torch build has).

    The matmul family (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_scaled_mm``), every fused
    scaled-dot-product-attention kernel (CPU flash, CUDA flash / memory-efficient / cuDNN, the overrideable
    one; its output and log-sum-exp are saved), and ``convolution``: the ops whose recomputation costs
    FLOPs rather than memory traffic, as in torch's selective-checkpointing docs and torchtitan's op list.
    """
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
             "_efficient_attention_forward")
    ops = (getattr(getattr(torch.ops.aten, name, None), "default", None) for name in names)
    return frozenset(op for op in ops if op is not None)


SAVED_OPS = _saved_ops()


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of :data:`SAVED_OPS`, recompute everything else (a selective-checkpoint policy function)."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_SELECTIVE_CONTEXT = functools.partial(create_selective_checkpoint_contexts, selective_policy)


def _import_class(path: str) -> type:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"policy entry {path!r} is not a class path such as 'my_pkg.model.Block'")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"policy entry {path!r} cannot be imported: {err}") from err
    if not isinstance(obj, type) or not issubclass(obj, nn.Module):
        raise ValueError(f"policy entry {path!r} is not a torch.nn.Module subclass")
    return obj


def _as_classes(policy: Any) -> tuple[type, ...] | None:
    if isinstance(policy, (str, type)):
        policy = [policy]
    if isinstance(policy, (list, tuple, set, frozenset)):
        classes = []
        for entry in policy:
            if isinstance(entry, str):
                classes.append(_import_class(entry))
            elif isinstance(entry, type) and issubclass(entry, nn.Module):
                classes.append(entry)
            else:
                raise TypeError(
                    f"policy entries must be torch.nn.Module classes or class-path strings, got {entry!r}"
                )
        if not classes:
            raise ValueError("policy is empty: give module classes, class paths or a callable (name, module) -> bool")
        return tuple(dict.fromkeys(classes))
    return None


def resolve_policy(policy: PolicyLike) -> Callable[[str, nn.Module], bool]:
    """Turn a policy into a predicate ``(qualified name, module) -> bool``.

    Accepted: a module class, a class-path string (``"lightning_memkit.demo.tiny_lm.Block"``), a set/list
    of either, or a callable ``(name, module) -> bool``. Strings are imported now, so a typo fails here.
    """
    classes = _as_classes(policy)
    if classes is not None:
        return lambda _name, module: isinstance(module, classes)
    if callable(policy):
        return policy
    raise TypeError(
        "policy must be a module class, a class-path string, a set/list of those, or a callable "
        f"(name, module) -> bool; got {type(policy).__name__}"
    )


def describe_policy(policy: PolicyLike) -> str:
    """A short text for messages: the class names, or the callable's name."""
    classes = _as_classes(policy)
    if classes is not None:
        return "{" + ", ".join(sorted(c.__qualname__ for c in classes)) + "}"
    return getattr(policy, "__qualname__", repr(policy))


def select_modules(model: nn.Module, policy: PolicyLike) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for each submodule the policy picks, outermost only, in model order.

    A match nested inside another match is skipped (the outer recomputation covers it). Raises
    ``ValueError`` listing the model's module classes when nothing matches.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    predicate = resolve_policy(policy)
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name == c or name.startswith(c + ".") for c, _ in chosen if c) or (chosen and chosen[0][0] == ""):
            continue
        if predicate(name, module):
            chosen.append((name, module))
    if not chosen:
        classes = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()})
        raise ValueError(
            f"policy={describe_policy(policy)} matched no submodule of {type(model).__name__}; "
            f"its module classes are: {', '.join(classes)}"
        )
    return chosen


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the blocks of ``model``'s longest ``nn.ModuleList`` whose entries share one class.

    The transformer blocks of most models (``TinyLM.blocks``, ``model.layers``); the first such list wins a tie,
    lists nested in a chosen block are ignored, and an empty result means the model has none.

    Example::

        >>> net = nn.Module()
        >>> net.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
        >>> net.heads = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])
        >>> [name for name, _ in repeated_blocks(net)]
        ['blocks.0', 'blocks.1', 'blocks.2']
    """
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(m) for m in module}) == 1 and (best is None or len(module) > len(best[1])):
            best = (name, module)
    if best is None:
        return []
    prefix = best[0] + "." if best[0] else ""
    return [(f"{prefix}{i}", m) for i, m in enumerate(best[1])]


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module.forward`` is currently patched by :func:`checkpoint_modules`."""
    return bool(getattr(vars(module).get("forward"), _MARK, False))


def recompute_mode(module: nn.Module) -> str | None:
    """``"full"`` or ``"selective"`` when :func:`checkpoint_modules` patched ``module``, else ``None``."""
    return getattr(vars(module).get("forward"), _MARK, None) or None


def _make_forward(module: nn.Module, previous: Callable | None, mode: str) -> Callable:
    ref = weakref.ref(module)
    cls_forward = type(module).forward
    extra = {"context_fn": _SELECTIVE_CONTEXT} if mode == "selective" else {}

    def forward(*args: Any, **kwargs: Any) -> Any:
        mod = ref()
        if mod is None:
            raise RuntimeError("the module of this checkpointed forward was garbage-collected")
        fn = previous if previous is not None else functools.partial(cls_forward, mod)
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)

    setattr(forward, _MARK, mode)
    forward._memkit_previous = previous  # type: ignore[attr-defined]
    return forward


class RecomputeHandle:
    """The patched modules (held weakly); :meth:`restore` or leaving the ``with`` block undoes the patches."""

    def __init__(self) -> None:
        self._patched: list[tuple[str, weakref.ref]] = []

    @property
    def names(self) -> list[str]:
        return [name for name, ref in self._patched if ref() is not None]

    @property
    def modes(self) -> dict[str, str]:
        """Name -> recompute mode (``"full"`` or ``"selective"``) of each module still patched by this handle."""
        out = {}
        for name, ref in self._patched:
            module = ref()
            if module is not None and recompute_mode(module) is not None:
                out[name] = recompute_mode(module)
        return out

    def add(self, modules: Iterable[tuple[str, nn.Module]], mode: ModeLike = "full") -> None:
        """Patch more modules (all validated first: nothing is patched if one is already patched).

        ``mode`` is ``"full"``, ``"selective"`` or a mapping name -> mode covering every given module.
        """
        items = list(modules)
        modes = _modes_for([name for name, _ in items], mode)
        for name, module in items:
            if not isinstance(module, nn.Module):
                raise TypeError(f"module {name!r} must be a torch.nn.Module, got {type(module).__name__}")
            if is_checkpointed(module):
                raise ValueError(f"module {name!r} ({type(module).__name__}) is already checkpointed")
        for name, module in items:
            module.forward = _make_forward(module, vars(module).get("forward"), modes[name])
            self._patched.append((name, weakref.ref(module)))

    def restore(self) -> None:
        """Put every patched ``forward`` back (latest first); modules patched again by others are left alone."""
        while self._patched:
            _name, ref = self._patched.pop()
            module = ref()
            if module is None:
                continue
            current = vars(module).get("forward")
            if not getattr(current, _MARK, False):
                continue
            previous = current._memkit_previous
            if previous is None:
                del module.forward
            else:
                module.forward = previous

    def __enter__(self) -> RecomputeHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    def __len__(self) -> int:
        return len(self.names)


def _modes_for(names: list[str], mode: ModeLike) -> dict[str, str]:
    """Name -> mode for ``names``: one mode for all, or a mapping that must cover exactly these names."""
    if isinstance(mode, str):
        mode = dict.fromkeys(names, mode)
    elif isinstance(mode, Mapping):
        missing = [n for n in names if n not in mode]
        unknown = [n for n in mode if n not in names]
        if missing or unknown:
            raise ValueError(
                f"mode must give a mode for each module and no other: missing {missing}, unknown {unknown}"
            )
    else:
        raise TypeError(f"mode must be 'full', 'selective' or a mapping name -> mode, got {type(mode).__name__}")
    for name, value in mode.items():
        if value not in RECOMPUTE_MODES:
            raise ValueError(f"mode[{name!r}]={value!r} is not a recompute mode; allowed: 'full', 'selective'")
    return dict(mode)


def checkpoint_modules(
    modules: Iterable[tuple[str, nn.Module]] | Iterable[nn.Module], mode: ModeLike = "full"
) -> RecomputeHandle:
    """Recompute each given module in backward; returns the handle that restores them.

    ``modules`` are ``(name, module)`` pairs (as :func:`select_modules` returns) or bare modules (named
    ``"0"``, ``"1"``, ...). ``mode``: ``"full"`` (keep only the inputs), ``"selective"`` (also keep the
    outputs of :data:`SAVED_OPS`) or a mapping name -> mode for each module.
    """
    pairs = []
    for i, item in enumerate(modules):
        pairs.append(item if isinstance(item, tuple) else (str(i), item))
    handle = RecomputeHandle()
    handle.add(pairs, mode)
    return handle
