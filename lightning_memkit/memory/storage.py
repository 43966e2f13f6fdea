"""The one home for storage accounting: identity, unique bytes, tensor walking and byte formatting.

Every release, profiler and report in the package counts memory through these helpers, so that "the
same storage" and "how many bytes" mean one thing everywhere:

- :func:`storage_of` / :func:`storage_key` / :func:`has_storage`: a tensor's untyped storage and its
  identity (shared by every view and alias of it);
- :func:`storage_use_count`: how many C++ owners (``TensorImpl`` objects, plus the Python storage
  object) hold a storage: the real reference count a release check starts from;
- :func:`iter_tensors` (nested lists, tuples and dicts), :func:`iter_op_tensors` (the flat argument
  lists of ATen ops, fast) and :func:`tensors_in` (containers *and* object attributes, bounded);
- :func:`unique_storage_bytes`: bytes of the distinct storages among some tensors;
- :func:`format_bytes`: ``1536 -> '1.50 KiB'``.

Example::

    >>> import torch
    >>> from lightning_memkit.memory.storage import format_bytes, storage_key, unique_storage_bytes
    >>> a = torch.zeros(256)                    # 1 KiB
    >>> v = a[10:20]                            # a view: same storage
    >>> storage_key(a) == storage_key(v)
    True
    >>> unique_storage_bytes([a, v, {"again": a}])
    1024
    >>> format_bytes(unique_storage_bytes([a, torch.zeros(256)]))
    '2.00 KiB'
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = [
    "storage_of",
    "storage_key",
    "has_storage",
    "storage_use_count",
    "iter_tensors",
    "iter_op_tensors",
    "tensors_in",
    "unique_storage_bytes",
    "format_bytes",
]


def storage_of(t: Any) -> torch.UntypedStorage | None:
    """``t``'s untyped storage, or ``None`` for non-tensors and tensors that own no memory (meta, sparse, nested)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.layout != torch.strided or t.is_nested:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def storage_key(t: torch.Tensor | torch.UntypedStorage) -> int:
    """Identity of a storage (or of ``t``'s): stable while it lives, shared by all views and aliases."""
    storage = t if isinstance(t, torch.UntypedStorage) else t.untyped_storage()
    return storage._cdata


def has_storage(t: Any) -> bool:
    """Whether ``t`` is a tensor that owns (or views) real memory."""
    return storage_of(t) is not None


def storage_use_count(t: torch.Tensor | torch.UntypedStorage) -> int:
    """C++ owners of the storage: one per ``TensorImpl`` on it (views, aliases, autograd copies), plus one
    for its Python ``UntypedStorage`` object, which torch keeps alive as long as the storage lives."""
    storage = t if isinstance(t, torch.UntypedStorage) else t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested structure of lists, tuples and dicts (any pytree)."""
    leaves, _ = tree_flatten(obj)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            yield leaf


def iter_op_tensors(items: Iterable[Any]) -> Iterator[torch.Tensor]:
    """Tensors among an ATen op's arguments or results (tensors, or lists and tuples of them).

    A hand-written walk for per-op hooks: ``tree_flatten`` costs more than the rest of their bookkeeping.
    """
    for x in items:
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            yield from iter_op_tensors(x)


def tensors_in(
    obj: Any, *, max_depth: int = 4, max_objects: int = 100_000, attributes: bool = True
) -> Iterator[torch.Tensor]:
    """Tensors reachable from ``obj`` through containers and, with ``attributes``, objects' ``__dict__``.

    Modules and classes are not entered. The walk is bounded: ``max_depth`` levels below ``obj`` and at
    most ``max_objects`` objects visited; each object is visited once.
    """
    seen: set[int] = set()
    budget = [max_objects]
    yield from _tensors_in(obj, max_depth, seen, budget, attributes)


def _tensors_in(obj: Any, depth: int, seen: set[int], budget: list[int], attributes: bool) -> Iterator[torch.Tensor]:
    if id(obj) in seen or depth < 0 or budget[0] <= 0:
        return
    seen.add(id(obj))
    budget[0] -= 1
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    elif attributes and hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        children = [vars(obj)]
    else:
        return
    for child in children[: budget[0]]:
        yield from _tensors_in(child, depth - 1, seen, budget, attributes)


def unique_storage_bytes(tensors: Any, *, skip: Iterable[int] = ()) -> int:
    """Bytes of the distinct storages among the tensors in ``tensors`` (any nested structure).

    Views and aliases count once; tensors without storage (meta, sparse) count 0; storages whose key
    is in ``skip`` are left out.
    """
    seen = set(skip)
    total = 0
    for t in iter_tensors(tensors) if not isinstance(tensors, torch.Tensor) else [tensors]:
        s = storage_of(t)
        if s is not None and s._cdata not in seen:
            seen.add(s._cdata)
            total += s.nbytes()
    return total


def format_bytes(n: int | float | None, *, grouping: bool = False) -> str:
    """``1536 -> '1.50 KiB'``: plain bytes below 1 KiB, GiB at most; ``None -> 'n/a'``.

    ``grouping=True`` writes thousands separators (``'1,536.00 GiB'``).
    """
    if n is None:
        return "n/a"
    value = float(n)
    sep = "," if grouping else ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:{sep}.0f} B" if unit == "B" else f"{value:{sep}.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
