"""Answer "why is this tensor still alive?": name the objects that hold it.

:func:`find_referrers` walks ``gc.get_referrers`` up from each large tensor to the nearest named holder
(an object that is not a plain container: an optimizer, a module, a callback, a frame, a closure) and
reports the holder's type, the attribute path down to the tensor and the bytes. The release check of
:func:`~lightning_memkit.memory.release_storage` uses the same walk to name what refuses a release.

Example::

    >>> import torch
    >>> from lightning_memkit.memory import find_referrers
    >>> w = torch.nn.Parameter(torch.randn(256, 256))
    >>> opt = torch.optim.Adam([w])
    >>> w.grad = torch.ones_like(w)
    >>> opt.step()
    >>> report = find_referrers(opt.state[w]["exp_avg"], min_bytes=0)
    >>> report.rows[0].holder, report.rows[0].path
    ('torch.optim.adam.Adam', 'Adam.state[Parameter(256, 256)]["exp_avg"]')
"""

from __future__ import annotations

import gc
import sys
import types
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_memkit.common.validation import check_int
from lightning_memkit.measure.storage import format_bytes, storage_key, storage_of, unique_storage_bytes

__all__ = ["find_referrers", "tensors_with_storages", "Referrer", "ReferrerReport"]

_CONTAINERS = (dict, list, tuple, set, frozenset, deque, types.CellType, types.MethodType)
_NO_HOLDER = "(no Python holder)"


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
        head = f"{self.targets} target(s), {format_bytes(self.total_bytes)} ({self.total_bytes} bytes) kept alive by:"
        width = max(len(format_bytes(r.nbytes)) for r in self.rows)
        lines = [f"  {format_bytes(r.nbytes).rjust(width)}  {r.path}   [{r.holder}; {r.target}]" for r in self.rows]
        return "\n".join([head, *lines])


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
        return _dict_edge(parent, child)
    if isinstance(parent, (list, tuple, deque)):
        return next((f"[{i}]" for i, v in enumerate(parent) if v is child), "[?]")
    if isinstance(parent, (set, frozenset)):
        return "{item}"
    if isinstance(parent, types.CellType):
        return ""
    if isinstance(parent, types.MethodType):
        return ".__self__" if parent.__self__ is child else ".__func__"
    if isinstance(parent, types.FrameType):
        return next((f" local {name!r}" for name, v in parent.f_locals.items() if v is child), " <stack>")
    return _attribute_edge(parent, child)


def _dict_edge(parent: dict, child: Any) -> str:
    """``[key]`` for a value, ``[key key]`` for a key, ``[?]`` when ``child`` is neither."""
    for k, v in parent.items():
        if v is child:
            return f"[{_key_text(k)}]"
        if k is child:
            return f"[key {_key_text(k)}]"
    return "[?]"


def _attribute_edge(parent: Any, child: Any) -> str:
    """An instance's ``.__dict__`` or ``.name`` (dict entry or slot), a function's closure, else ``.<ref>``."""
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
            _visit(ref, by_id, found, seen, max_holders, next_objs, next_meta)
        refs = None
        objs, meta = next_objs, next_meta
    return found


def _visit(ref: Any, by_id: dict[int, list[tuple[int, list[str]]]], found: list[list[tuple[str, str]]],
           seen: list[set[int]], max_holders: int, next_objs: list[Any],
           next_meta: list[tuple[int, list[str]]]) -> None:
    """Record what ``ref`` holds among the level's objects (``by_id``): a named ``ref`` is a holder found,
    a plain container joins the next level (``next_objs`` and its ``(target, path)`` in ``next_meta``)."""
    named = _is_named(ref)
    for child in _children(ref, by_id):
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


def _children(ref: Any, by_id: dict[int, Any]) -> list[Any]:
    """What ``ref`` refers to: a frame's locals among ``by_id``; a function's referents less its globals
    (a function only reads its module's namespace: the module is the holder)."""
    if isinstance(ref, types.FrameType):
        return _frame_refs(ref, by_id)
    children = gc.get_referents(ref)
    if isinstance(ref, types.FunctionType):
        return [child for child in children if child is not ref.__globals__]
    return children


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
    """Every live Python tensor whose storage key (see ``storage.storage_key``) is in ``keys``."""
    wanted = set(keys)
    out = []
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and storage_of(obj) is not None and storage_key(obj) in wanted:
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
    ``max_holders`` rows are reported per target. Objects frozen by ``gc.freeze()`` are not searched
    (``gc.get_referrers`` skips them): a holder made before the freeze is missing from the report.

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
    check_int(min_bytes, "min_bytes", minimum=0, owner="find_referrers")
    check_int(max_depth, "max_depth", minimum=1, owner="find_referrers")
    check_int(max_holders, "max_holders", minimum=1, owner="find_referrers")
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
            sized.append((s.nbytes(), storage_key(s), t))
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
        return unique_storage_bytes([*obj.parameters(), *obj.buffers()])
    return 0
