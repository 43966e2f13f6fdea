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
- :func:`format_bytes`: ``1536 -> '1.50 KiB'``;
- :func:`unexplained_references`: Python references to a tensor that neither the running frames nor
  their own containers explain (a ``ctx`` attribute, a ``saved_tensors_hooks`` pack, a list somewhere).

Example::

    >>> import torch
    >>> from lightning_memkit.measure.storage import format_bytes, storage_key, unique_storage_bytes
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

import gc
import inspect
import sys
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
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
    "may_overlap",
    "unexplained_references",
    "storage_object_references",
    "caller_frames",
]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds ``t``'s memory on this process: a ``DTensor``'s local shard (any wrapper subclass
    with exactly one inner tensor), else ``t`` itself. A wrapper's own storage has no data and the global size."""
    while type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):
        names, _ctx = t.__tensor_flatten__()
        inner = [x for x in (getattr(t, name) for name in names) if isinstance(x, torch.Tensor)]
        if len(inner) != 1:
            break
        t = inner[0]
    return t


def storage_of(t: Any) -> torch.UntypedStorage | None:
    """``t``'s untyped storage, or ``None`` for non-tensors and tensors that own no memory (meta, sparse, nested).

    For a ``DTensor`` (FSDP2 parameters, gradients and optimizer state) it is the storage of the local shard.
    """
    if not isinstance(t, torch.Tensor):
        return None
    t = _local(t)
    if t.device.type == "meta" or t.layout != torch.strided or t.is_nested:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _untyped(t: torch.Tensor | torch.UntypedStorage) -> torch.UntypedStorage:
    return t if isinstance(t, torch.UntypedStorage) else _local(t).untyped_storage()


def storage_key(t: torch.Tensor | torch.UntypedStorage) -> int:
    """Identity of a storage (or of ``t``'s): stable while it lives, shared by all views and aliases."""
    return _untyped(t)._cdata


def has_storage(t: Any) -> bool:
    """Whether ``t`` is a tensor that owns (or views) real memory."""
    return storage_of(t) is not None


def storage_use_count(t: torch.Tensor | torch.UntypedStorage) -> int:
    """C++ owners of the storage: one per ``TensorImpl`` on it (views, aliases, autograd copies), plus one
    for its Python ``UntypedStorage`` object, which torch keeps alive as long as the storage lives."""
    return torch._C._storage_Use_Count(storage_key(t))


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


def may_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (an ``expand``ed or overlapping ``as_strided`` view).

    Exact for dense tensors and zero strides; a layout whose strides cannot be ordered so that each
    exceeds the reach of the smaller ones counts as overlapping (it cannot be proven safe to write).
    """
    if t.numel() == 0:
        return False
    reach = 0  # the largest element offset reachable through the dimensions with smaller strides
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def unique_storage_bytes(tensors: Any, *, skip: Iterable[int] = ()) -> int:
    """Bytes of the distinct storages among the tensors in ``tensors`` (any nested structure).

    Views and aliases count once; tensors without storage (meta, sparse) count 0; storages whose key
    is in ``skip`` are left out.
    """
    seen = set(skip)
    total = 0
    for t in iter_tensors(tensors) if not isinstance(tensors, torch.Tensor) else [tensors]:
        s = storage_of(t)
        if s is not None and storage_key(s) not in seen:
            seen.add(storage_key(s))
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


# -- who else holds a tensor: the reference counts a release check starts from ---------------------------
def _python_refs(obj: Any) -> int:
    """Python references to ``obj`` from outside this call (its argument and parameter not counted)."""
    return sys.getrefcount(obj) - 2


def _calibrate_preserved_ref() -> int:
    """Python references torch adds to a tensor object while other ``TensorImpl`` owners exist (0 or 1).

    torch keeps a tensor's Python object alive from C++ while its ``TensorImpl`` has other owners
    (PyObject preservation); measured once, so the accounting follows the installed torch.
    """
    t = torch.empty(1)
    alone = _python_refs(t)
    view = t.view(1)
    shared = _python_refs(t)
    del view
    return shared - alone


_PRESERVED_REF = _calibrate_preserved_ref()


def _storage_object_refs(t: torch.Tensor) -> int:
    storage = t.untyped_storage()
    return _python_refs(storage) - 1  # minus the local above


_STORAGE_OBJECT_REFS = _storage_object_refs(torch.empty(1))  # torch's own hold on the Python storage object


def storage_object_references(t: torch.Tensor) -> int:
    """Python references to ``t``'s ``UntypedStorage`` object beyond torch's own (0 when nobody keeps it)."""
    return _storage_object_refs(t) - _STORAGE_OBJECT_REFS


_MODULE_CALL_HIDDEN: list[int] = []


class _Probe(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> None:  # returns nothing: its output must not alias the argument
        return None


def _module_call_hidden_refs() -> int:
    """References to a positional argument that a ``Module.__call__`` in progress holds where no frame
    shows them (the interpreter builds an argument tuple in C for ``module(x)``): measured once, in a
    forward hook of a fresh module, so that it follows the running interpreter and torch."""
    if not _MODULE_CALL_HIDDEN:
        _MODULE_CALL_HIDDEN.append(0)  # measured with no allowance
        seen: list[int] = []
        probe = _Probe()
        probe.register_forward_hook(lambda _m, args, _out: seen.append(unexplained_references(args[0])))
        probe(torch.empty(1))
        _MODULE_CALL_HIDDEN[0] = max(0, seen[0]) if seen else 0
    return _MODULE_CALL_HIDDEN[0]


def caller_frames() -> list[types.FrameType]:
    """The frames running in this thread, from the caller of this function down to the first."""
    frames, f = [], sys._getframe(1)
    while f is not None:
        frames.append(f)
        f = f.f_back
    return frames


def _occurrences(items: Iterable[Any], obj: Any) -> int:
    """How many of ``items`` are ``obj`` itself (a plain loop: a generator would capture ``obj`` in a cell)."""
    n = 0
    for x in items:
        if x is obj:
            n += 1
    return n


#: Frames of torch's own module-call machinery (``Module.__call__`` and its ``inner`` closure): their
#: argument tuples live in cells and on the interpreter stack (``forward_call(*args)``), so a container
#: they hold counts as theirs with one stack reference more.
_CALL_MACHINERY = ("torch/nn/modules/module.py",)


@dataclass
class _FrameRefs:
    counts: dict[int, int] = field(default_factory=dict)  # object id -> frame references to it
    containers: dict[int, tuple[Any, int, int]] = field(default_factory=dict)  # id -> (obj, hits of t, slack)
    namespaces: set[int] = field(default_factory=set)

    machinery_args: int = 0  # occurrences of t among the arguments of running ``Module.__call__`` frames
    cell_hits: int = 0  # cell variables of running frames whose content is t

    def add(self, v: Any, t: torch.Tensor, slack: int, containers: bool = True) -> None:
        self.counts[id(v)] = self.counts.get(id(v), 0) + 1
        if containers and type(v) in (tuple, list, dict):
            entry = self.containers.get(id(v))
            if entry is not None:
                self.containers[id(v)] = (v, entry[1], max(entry[2], slack))
                return
            k = _occurrences(v.values() if type(v) is dict else v, t)
            if k:
                self.containers[id(v)] = (v, k, slack)


def _scan_frame(f: types.FrameType, t: torch.Tensor, refs: _FrameRefs) -> None:
    code = f.f_code
    optimized = bool(code.co_flags & inspect.CO_OPTIMIZED)
    trusted = code.co_filename.replace("\\", "/").endswith(_CALL_MACHINERY)
    skip = set() if trusted or not optimized else set(code.co_cellvars) | set(code.co_freevars)
    loc = f.f_locals
    if not optimized:  # a module or exec namespace: the dict itself, counted once
        if id(loc) in refs.namespaces:
            return
        refs.namespaces.add(id(loc))
    for name, v in loc.items():
        if name not in skip:  # a cell may be shared with closures: not the frame's own reference
            refs.add(v, t, 1 if trusted else 0, containers=optimized)  # a global list is no local one
        elif v is t:
            refs.cell_hits += 1
    if trusted and code.co_name == "_wrapped_call_impl" and type(loc.get("args")) is tuple:
        refs.machinery_args += _occurrences(loc["args"], t)
    if type(loc) is dict and optimized:
        loc.clear()


def _count_frame_locals(frames: list[types.FrameType], t: torch.Tensor) -> _FrameRefs:
    """How many locals of ``frames`` refer to each object, and the tuples, lists and dicts among them
    that hold ``t`` directly.

    Python 3.11/3.12 materialise a frame's locals into a cached dict on ``f_locals``; that snapshot is
    cleared again (it is only a cache) so that it neither adds references nor keeps objects alive.
    """
    refs = _FrameRefs()
    for f in frames:
        _scan_frame(f, t, refs)
    return refs


def unexplained_references(t: torch.Tensor, *, held_by: Iterable[Any] = ()) -> int:
    """Python references to ``t`` that nothing the caller can vouch for explains (0 when none).

    Explained are: fast locals of the frames running in this thread (the caller and its callers), the
    tuples, lists and dicts that such locals hold when nothing but those frames holds them in turn (a
    ``Module.__call__``'s ``args``), the objects in ``held_by`` (a queue entry of the caller's), and the
    reference torch itself adds while other ``TensorImpl`` owners exist. Anything else is a holder the
    caller does not control: a container or an attribute (a ``ctx.x = x`` of a custom autograd
    Function), a closure cell, a ``saved_tensors_hooks`` pack (``save_on_cpu`` on CPU packs the tensor
    itself), a C++ extension, another thread. Temporaries on an interpreter stack are not visible and
    count as unexplained: the answer errs towards "held".
    """
    tracer = sys.gettrace()  # a tracer refills f_locals snapshots at every line: counts would drift
    sys.settrace(None)
    try:
        return _unexplained(t, held_by)
    finally:
        sys.settrace(tracer)


def _unexplained(t: torch.Tensor, held_by: Iterable[Any]) -> int:
    frames = caller_frames()
    refs = _count_frame_locals(frames, t)
    explained = refs.counts.get(id(t), 0)
    for c, k, slack in refs.containers.values():
        # references to c besides the frames': the entry tuple holds it once, the loop variable once
        if _python_refs(c) - 2 <= refs.counts.get(id(c), 0) + slack:
            explained += k
    c = None
    refs.containers.clear()
    for o in held_by:
        explained += _occurrences(gc.get_referents(o), t)
    o = None
    frames.clear()
    if refs.machinery_args:
        explained += refs.machinery_args * _module_call_hidden_refs()
    preserved = _PRESERVED_REF if t._use_count() > 1 else 0
    extra = _python_refs(t) - preserved - explained
    return extra - _frame_cells(t) if extra > 0 and refs.cell_hits else extra


def _frame_cells(t: torch.Tensor) -> int:
    """References to ``t`` from closure cells that only a running frame holds (a local some closure
    captured and that closure is gone). Costs a scan of the heap: run only when the fast count fell short."""
    found = 0
    for r in gc.get_referrers(t):
        if type(r) is types.CellType and _python_refs(r) == 3 and len(gc.get_referrers(r)) == 1:
            found += 1  # besides the scan's list and loop variable, one reference: a frame's cell slot
    return found
