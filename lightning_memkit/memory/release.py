"""Give memory back between phases, and name what still holds it when it does not go.

Three tools for the moment a phase (fit, validate, test, a fold of a sweep) is over:

- :func:`release_optimizer_state` empties an optimizer's ``state`` in place, so every holder of the
  optimizer (a wrapper, a scheduler, the model through its trainer) sees it empty at once.
- :func:`empty_device_cache` runs the garbage collector and hands cached allocator blocks back to the
  driver (CUDA, XPU, MPS).
- :func:`find_referrers` answers "why is this tensor still alive?": it walks ``gc.get_referrers`` up
  from each large tensor to the nearest named holder (an object that is not a plain container) and
  reports the holder's type, the attribute path down to the tensor and the bytes.

Example::

    >>> import torch
    >>> from lightning_memkit.memory import find_referrers, release_optimizer_state
    >>> w = torch.nn.Parameter(torch.randn(256, 256))
    >>> opt = torch.optim.Adam([w])
    >>> w.grad = torch.ones_like(w)
    >>> opt.step()
    >>> report = find_referrers(opt.state[w]["exp_avg"], min_bytes=0)
    >>> report.rows[0].holder, report.rows[0].path
    ('torch.optim.adam.Adam', 'Adam.state[Parameter(256, 256)]["exp_avg"]')
    >>> release_optimizer_state(opt)  # exp_avg + exp_avg_sq + step, all freed
    524292
"""

from __future__ import annotations

import gc
import sys
import types
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_memkit.memory.live_peak import storage_key, storage_of

__all__ = [
    "release_optimizer_state",
    "empty_device_cache",
    "find_referrers",
    "tensors_with_storages",
    "Referrer",
    "ReferrerReport",
]

_CONTAINERS = (dict, list, tuple, set, frozenset, deque, types.CellType, types.MethodType)
_NO_HOLDER = "(no Python holder)"


# -- optimizer state --------------------------------------------------------------------------------


def _state_tensors(obj: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, dict):
        for v in obj.values():
            yield from _state_tensors(v, depth + 1)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _state_tensors(v, depth + 1)


def _storage_refs(obj: Any, skip: set[int]) -> dict[int, tuple[weakref.ref, int]]:
    refs: dict[int, tuple[weakref.ref, int]] = {}
    for t in _state_tensors(obj):
        s = storage_of(t)
        if s is not None and s._cdata not in skip and s._cdata not in refs:
            refs[s._cdata] = (weakref.ref(s), s.nbytes())
    return refs


def release_optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    """Clear ``optimizer.state`` in place and return the bytes of state storage that this freed.

    The dict object itself is emptied (not replaced), so a Lightning ``LightningOptimizer``, an LR
    scheduler or anything else that shares it sees the empty state. Parameters are never touched, and
    the optimizer stays usable: the next ``step()`` rebuilds its state from zero, as for a new optimizer.
    The returned count is exact: storages still held elsewhere after the clear are not counted.

    Example::

        >>> import torch
        >>> from lightning_memkit.memory import release_optimizer_state
        >>> p = torch.nn.Parameter(torch.zeros(1024))
        >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> p.grad = torch.ones(1024)
        >>> opt.step()
        >>> release_optimizer_state(opt), len(opt.state)
        (4096, 0)
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    state = optimizer.state
    if not isinstance(state, dict):
        raise TypeError(f"optimizer.state must be a dict, got {type(state).__name__}")
    params = {storage_key(p) for g in optimizer.param_groups for p in g["params"] if storage_of(p) is not None}
    refs = _storage_refs(list(state.values()), params)
    state.clear()
    return sum(n for ref, n in refs.values() if ref() is None)


# -- device cache -----------------------------------------------------------------------------------
def _reserved(kind: str, index: int | None) -> int | None:
    if kind == "cuda":
        return torch.cuda.memory_reserved(index)
    if kind == "xpu":
        return torch.xpu.memory_reserved(index)
    if kind == "mps":
        fn = getattr(torch.mps, "driver_allocated_memory", None)
        return int(fn()) if fn is not None else None
    return None


def _accelerators(device: torch.device | str | None) -> list[tuple[str, int | None]]:
    if device is not None:
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda", "xpu", "mps"):
            raise ValueError(f"device={str(dev)!r} is not supported; allowed: cpu, cuda, xpu, mps or None (all)")
        if dev.type == "cpu":
            return []
        mod = getattr(torch, dev.type)
        if not (mod.is_available() if dev.type != "mps" else torch.backends.mps.is_available()):
            return []
        if dev.type == "mps":
            return [("mps", None)]
        return [(dev.type, dev.index if dev.index is not None else mod.current_device())]
    found: list[tuple[str, int | None]] = []
    for kind in ("cuda", "xpu"):
        mod = getattr(torch, kind, None)
        if mod is not None and mod.is_available() and (kind != "cuda" or torch.cuda.is_initialized()):
            found += [(kind, i) for i in range(mod.device_count())]
    if torch.backends.mps.is_available():
        found.append(("mps", None))
    return found


def empty_device_cache(device: torch.device | str | None = None) -> int:
    """Collect garbage, then return cached allocator blocks to the driver; returns the bytes given back.

    ``device=None`` covers every initialised CUDA/XPU device and MPS; ``"cuda:1"`` only that card. The
    count is the drop in reserved memory (``torch.cuda.memory_reserved`` and its XPU/MPS equivalents);
    on CPU there is no cache and the result is 0.

    Example::

        >>> from lightning_memkit.memory import empty_device_cache
        >>> empty_device_cache("cpu")
        0
    """
    gc.collect()
    freed = 0
    for kind, index in _accelerators(device):
        if kind == "cuda":
            with torch.cuda.device(index):
                torch.cuda.synchronize()
                before = _reserved(kind, index)
                torch.cuda.empty_cache()
        elif kind == "xpu":
            torch.xpu.synchronize(index)
            before = _reserved(kind, index)
            torch.xpu.empty_cache()
        else:
            torch.mps.synchronize()
            before = _reserved(kind, index)
            torch.mps.empty_cache()
        after = _reserved(kind, index)
        if before is not None and after is not None:
            freed += max(0, before - after)
    return freed


# -- referrers --------------------------------------------------------------------------------------
@dataclass
class Referrer:
    """One reason a tensor (or object) is alive: ``holder`` reaches it through ``path``.

    ``holder`` is the qualified type of the nearest named holder (``"torch.optim.adam.Adam"``, ``"frame"``,
    ``"module"``) or ``"(no Python holder)"`` when only C++ keeps the storage (an autograd graph, a
    hook, an extension). ``nbytes`` is the target's storage size; ``target`` describes it.
    """

    holder: str
    path: str
    nbytes: int
    target: str


@dataclass
class ReferrerReport:
    """What :func:`find_referrers` found: ``rows`` (largest targets first) and the deduplicated total."""

    rows: list[Referrer] = field(default_factory=list)
    total_bytes: int = 0
    targets: int = 0

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def holders(self) -> set[str]:
        """The distinct holder types."""
        return {r.holder for r in self.rows}

    def __str__(self) -> str:
        if not self.rows:
            return "no holders found"
        head = f"{self.targets} target(s), {_fmt(self.total_bytes)} ({self.total_bytes} bytes) kept alive by:"
        width = max(len(_fmt(r.nbytes)) for r in self.rows)
        lines = [f"  {_fmt(r.nbytes).rjust(width)}  {r.path}   [{r.holder}; {r.target}]" for r in self.rows]
        return "\n".join([head, *lines])


def _fmt(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if abs(value) < 1024:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        kind = "Parameter" if isinstance(obj, torch.nn.Parameter) else "Tensor"
        return f"{kind}({', '.join(map(str, obj.shape))})"
    return type(obj).__name__


def _target_text(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"{_describe(obj)} {str(obj.dtype).removeprefix('torch.')} {obj.device}"
    return _describe(obj)


def _qualname(obj: Any) -> str:
    if isinstance(obj, types.FrameType):
        return "frame"
    if isinstance(obj, types.ModuleType):
        return "module"
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}" if cls.__module__ != "builtins" else cls.__qualname__


def _key_text(key: Any) -> str:
    if isinstance(key, str):
        return f'"{key}"'
    if isinstance(key, (int, float, bool)) or key is None:
        return repr(key)
    return _describe(key)


def _edge(parent: Any, child: Any) -> str:
    """How ``parent`` refers to ``child``, as a path fragment."""
    if isinstance(parent, dict):
        for k, v in parent.items():
            if v is child:
                return f"[{_key_text(k)}]"
            if k is child:
                return f"[key {_key_text(k)}]"
        return "[?]"
    if isinstance(parent, (list, tuple, deque)):
        for i, v in enumerate(parent):
            if v is child:
                return f"[{i}]"
        return "[?]"
    if isinstance(parent, (set, frozenset)):
        return "{item}"
    if isinstance(parent, types.CellType):
        return ""
    if isinstance(parent, types.MethodType):
        return ".__self__" if parent.__self__ is child else ".__func__"
    if isinstance(parent, types.FrameType):
        for name, v in parent.f_locals.items():
            if v is child:
                return f" local {name!r}"
        return " <stack>"
    d = _instance_dict(parent)
    if d is child:
        return ".__dict__"
    if d is not None:
        for name, v in d.items():
            if v is child:
                return f".{name}"
    for name in _slots(type(parent)):
        if getattr(parent, name, None) is child:
            return f".{name}"
    if isinstance(parent, types.FunctionType):
        return " (closure)"
    return ".<ref>"


def _instance_dict(obj: Any) -> dict | None:
    if isinstance(obj, type):
        return None
    try:
        d = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None
    return d if isinstance(d, dict) else None


def _slots(cls: type) -> list[str]:
    names: list[str] = []
    for c in cls.__mro__:
        s = c.__dict__.get("__slots__", ())
        names += [s] if isinstance(s, str) else list(s)
    return names


def _holder_label(holder: Any) -> str:
    if isinstance(holder, types.FrameType):
        code = holder.f_code
        return f"frame {code.co_name} ({code.co_filename.rsplit('/', 1)[-1]}:{holder.f_lineno})"
    if isinstance(holder, types.ModuleType):
        return f"module {holder.__name__}"
    if isinstance(holder, types.FunctionType):
        return f"function {holder.__qualname__}"
    if isinstance(holder, type):
        return f"class {holder.__qualname__}"
    return type(holder).__name__


def _join(label: str, edges: list[str]) -> str:
    """``label`` followed by the edges (holder first); ``.__dict__["x"]`` reads ``.x``."""
    out, in_dict = label, False
    for e in edges:
        if e == ".__dict__":
            in_dict = True
            continue
        if in_dict and e.startswith('["') and e.endswith('"]'):
            e = "." + e[2:-2]
        in_dict = False
        out += e
    return out


def _is_named(obj: Any) -> bool:
    """A holder worth naming: anything but a plain container (a dict/list subclass from user code counts)."""
    if isinstance(obj, _CONTAINERS):
        return type(obj).__module__ not in ("builtins", "collections")
    return True


def _walk(targets: list[Any], ignore: set[int], max_depth: int, max_holders: int) -> list[list[tuple[str, str]]]:
    """Per target, ``(holder type, path)`` pairs of its nearest named holders.

    Breadth-first up the referrer graph, one ``gc.get_referrers`` scan per level for all targets together
    (each scan walks every tracked object, so this is what bounds the cost); ``gc.get_referents`` of each
    referrer then tells which of the level's objects it holds.
    """
    found: list[list[tuple[str, str]]] = [[] for _ in targets]
    seen = [{id(t)} for t in targets]
    objs: list[Any] = list(targets)  # this level's objects ...
    meta: list[tuple[int, list[str]]] = [(i, []) for i in range(len(targets))]  # ... and (target, path) for each
    keep: list[Any] = []  # referrers visited stay alive, so their ids stay unique during the walk
    frames = _running_frames(ignore)
    internal = {id(found), id(keep), id(targets), id(frames)}
    for _ in range(max_depth):
        if not objs:
            break
        by_id: dict[int, list[tuple[int, list[str]]]] = {}
        for obj, m in zip(objs, meta):
            by_id.setdefault(id(obj), []).append(m)
        internal |= {id(objs), id(meta), id(by_id)}
        refs = gc.get_referrers(*objs)
        internal.add(id(refs))
        next_objs: list[Any] = []
        next_meta: list[tuple[int, list[str]]] = []
        internal |= {id(next_objs), id(next_meta)}
        for ref in [*refs, *frames]:  # running frames hide their locals from gc: they are checked directly
            if id(ref) in ignore or id(ref) in internal or _own_frame(ref):
                continue
            keep.append(ref)
            named = _is_named(ref)
            for child in gc.get_referents(ref) if not isinstance(ref, types.FrameType) else _frame_refs(ref, by_id):
                for i, path in by_id.get(id(child), ()):
                    if len(found[i]) >= max_holders or id(ref) in seen[i]:
                        continue
                    seen[i].add(id(ref))
                    edge = _edge(ref, child)
                    if isinstance(ref, types.FrameType) and edge == " <stack>":
                        continue  # a temporary on some caller's value stack (an argument being passed)
                    if named:
                        found[i].append((_qualname(ref), _join(_holder_label(ref), [edge, *path])))
                    else:
                        next_objs.append(ref)
                        next_meta.append((i, [edge, *path]))
        refs = None
        objs, meta = next_objs, next_meta
    return found


def _frame_refs(frame: types.FrameType, by_id: dict[int, Any]) -> list[Any]:
    return [v for v in frame.f_locals.values() if id(v) in by_id]


def _own_frame(obj: Any) -> bool:
    return isinstance(obj, types.FrameType) and obj.f_code.co_filename == __file__


def _running_frames(ignore: set[int]) -> list[types.FrameType]:
    frames = []
    for top in sys._current_frames().values():
        f = top
        while f is not None:
            if id(f) not in ignore and f.f_code.co_filename != __file__:
                frames.append(f)
            f = f.f_back
    top = None  # this very frame is among the tops: no reference cycle through our own local
    return frames


def tensors_with_storages(keys: Iterable[int]) -> list[torch.Tensor]:
    """Every live Python tensor whose storage key (see ``live_peak.storage_key``) is in ``keys``."""
    wanted = set(keys)
    out = []
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):
            s = storage_of(obj)
            if s is not None and s._cdata in wanted:
                out.append(obj)
    return out


def find_referrers(
    obj_or_tensors: Any,
    min_bytes: int = 1 << 20,
    *,
    max_depth: int = 8,
    max_holders: int = 4,
    ignore: Iterable[Any] = (),
) -> ReferrerReport:
    """Name the objects that keep large tensors (or one object) alive: the leak report after a release.

    For each tensor whose storage has at least ``min_bytes`` (a tensor, or an iterable of tensors, may be
    given; any other object is looked up itself, whatever its size), the walk goes up
    ``gc.get_referrers`` through plain containers (dict, list, tuple, set, cell, bound method) at most
    ``max_depth`` levels to the nearest *named* holders: a class instance (an optimizer, a module, a
    callback, the trainer), a frame (a local variable), a module global or a closure. Each gives a
    :class:`Referrer` row: the holder's type, the path from the holder down to the target
    (``Adam.state[Parameter(4096, 4096)]["exp_avg"]``) and the bytes. A storage that no Python object
    reaches (only the autograd graph or C++ holds it) is reported with holder ``"(no Python holder)"``.
    Objects in ``ignore`` (and this function's own frames) are not counted as holders. At most
    ``max_holders`` rows are reported per target.

    Example::

        >>> import torch
        >>> from lightning_memkit.memory import find_referrers
        >>> class Cache:
        ...     pass
        >>> cache = Cache()
        >>> cache.kv = {"layer0": torch.zeros(1 << 18)}   # 1 MiB
        >>> [(r.holder.rsplit(".", 1)[-1], r.path) for r in find_referrers(cache.kv["layer0"])]
        [('Cache', 'Cache.kv["layer0"]')]
    """
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
    for name, value in (("max_depth", max_depth), ("max_holders", max_holders)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if isinstance(obj_or_tensors, torch.Tensor):
        targets: list[Any] = [obj_or_tensors]
    elif isinstance(obj_or_tensors, (list, tuple, set, frozenset)) and all(
        isinstance(t, torch.Tensor) for t in obj_or_tensors
    ):
        targets = list(obj_or_tensors)
    else:
        targets = [obj_or_tensors]
    ignore_ids = {id(o) for o in ignore} | {id(obj_or_tensors), id(targets)}
    sized: list[tuple[int, int | None, Any]] = []
    for t in targets:
        s = storage_of(t) if isinstance(t, torch.Tensor) else None
        if isinstance(t, torch.Tensor):
            if s is None or s.nbytes() < min_bytes:
                continue
            sized.append((s.nbytes(), s._cdata, t))
        else:
            sized.append((_object_bytes(t), None, t))
    sized.sort(key=lambda x: -x[0])
    ignore_ids |= {id(sized)} | {id(entry) for entry in sized}
    report = ReferrerReport()
    counted: set[int] = set()
    holders = _walk([t for _, _, t in sized], ignore_ids, max_depth, max_holders)
    for (nbytes, key, target), found in zip(sized, holders):
        if key is None or key not in counted:
            report.total_bytes += nbytes
            report.targets += 1
            if key is not None:
                counted.add(key)
        text = _target_text(target)
        if not found:
            why = f"({text}: held from C++ only, e.g. by an autograd graph)"
            report.rows.append(Referrer(_NO_HOLDER, why, nbytes, text))
        for holder, path in found:
            report.rows.append(Referrer(holder, path, nbytes, text))
    return report


def _object_bytes(obj: Any) -> int:
    if isinstance(obj, torch.nn.Module):
        seen, total = set(), 0
        for t in [*obj.parameters(), *obj.buffers()]:
            s = storage_of(t)
            if s is not None and s._cdata not in seen:
                seen.add(s._cdata)
                total += s.nbytes()
        return total
    return 0
