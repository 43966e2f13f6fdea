"""Free a tensor's storage early while the tensor object (shape, dtype, ``grad_fn``) stays usable for autograd.

``release_storage(t)`` calls ``t.untyped_storage().resize_(0)``: the bytes go back to the allocator at
once, and everything that needs only ``t``'s metadata (the graph that produced it, a stage-wise
``torch.autograd.backward(t, grad)``) keeps working. Reading ``t`` afterwards is undefined behaviour in
torch (a crash on CPU, an illegal access on CUDA), so with ``check=True`` (the default) the release is
refused with :class:`UnsafeReleaseError` when something visible to torch can still read the storage:

* another tensor shares the storage (a view, a ``.detach()``, the output of an "exchange" that returned
  its input). Counted exactly: ``torch._C._storage_Use_Count`` is the number of ``TensorImpl`` objects
  (plus other C++ owners) holding the storage, plus one for its Python ``UntypedStorage`` object, which
  torch keeps alive (PyObject preservation) for as long as the storage lives;
* an autograd node saved it for backward. A node that saved ``t`` itself holds one more reference on
  ``t``'s ``TensorImpl`` (``Tensor._use_count()``, the count ``torch.utils.swap_tensors`` relies on); a
  node that saved it as its own output holds another ``TensorImpl`` on the storage. Where either count
  is above its baseline, the graph between ``t`` and the given ``outputs`` (its consumers' results) is
  searched, without unpacking anything, for the nodes that saved it (``_raw_saved_*`` of built-in
  nodes, ``save_for_backward`` and ``ctx`` attributes of custom Functions). Only nodes known to read the
  saved tensor's metadata and never its data are accepted (``IndexAddBackward0.source``: backward only
  expands the gradient to its shape); every holder must be accounted for, or the release is refused;
* one of ``outputs`` shares its storage (the consumer returned its input);
* anything else holds ``t``'s Python object: a ``ctx`` attribute, a ``saved_tensors_hooks`` pack that kept
  ``t`` itself (``save_on_cpu`` on CPU), a container or closure that outlives the call, or its
  ``UntypedStorage`` object is kept. ``sys.getrefcount`` is checked against what the running frames of
  this thread explain (:func:`~lightning_memkit.measure.storage.unexplained_references`); the refusal
  names the holder. ``held_by=`` declares holders that read only metadata (a schedule's list).

What no count sees: the caller's own later reads (the running frames are the caller's). Set
``MEMKIT_POISON=1`` (or ``poison=True``) to find those: the storage is then kept and filled with a
sentinel (all bytes ``0xFF``: NaN for every float dtype, ``-1`` for signed integers) and, while
:func:`poison_guard` is active (``release_stage_boundaries`` enters it for you), any later op that reads
it, in forward or backward, and any ``.tolist()``/``.numpy()``/``.item()``, raises
:class:`PoisonedReadError` naming where the tensor was released. Poisoning is a debugging aid: it frees
nothing.

Bad inputs always raise, whatever ``check``: a parameter or a leaf that requires grad (its storage is
the value being trained), a view (its base shares the storage), a sparse, nested or meta tensor.

Example::

    >>> import torch
    >>> from lightning_memkit.memory import release_storage
    >>> h = torch.randn(8, 4, requires_grad=True) * 2      # a stage output
    >>> y = (h + 1).sum()                                 # its consumer saves nothing of h
    >>> release_storage(h, outputs=y)                     # bytes freed
    128
    >>> y.backward()                                      # autograd needs only h's metadata
    >>> z = h.shape                                       # still there
"""

from __future__ import annotations

import os
import traceback
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from inspect import CO_OPTIMIZED
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memkit.measure.live_peak import note_storage_resized
from lightning_memkit.measure.storage import (
    caller_frames,
    has_storage,
    iter_tensors,
    storage_key,
    storage_object_references,
    storage_use_count,
    unexplained_references,
)
from lightning_memkit.release.referrers import find_referrers

__all__ = [
    "release_storage",
    "verify_release",
    "poison_guard",
    "poison_enabled",
    "is_released",
    "UnsafeReleaseError",
    "PoisonedReadError",
    "METADATA_ONLY_SAVES",
]

POISON_ENV = "MEMKIT_POISON"
POISON_BYTE = 0xFF  # NaN in every IEEE float dtype (and fp8 e4m3fn / e5m2); -1 in signed integers

#: ``(node class name, saved name)`` pairs whose backward reads only the saved tensor's metadata.
METADATA_ONLY_SAVES: frozenset[tuple[str, str]] = frozenset({("IndexAddBackward0", "source")})

#: Name the holders of a refused release (a few scans of the heap, 0.1 s on a large one). Set to False
#: where many refusals are expected and their cause is known: the refusal itself does not change.
NAME_HOLDERS = True

_MAX_NODES = 100_000  # graph search limit when the producer of ``t`` gives no lower bound
_OWN_FILES = tuple(f"lightning_memkit/release/{n}.py" for n in ("storage_release", "stage_boundary", "deferred_free"))


class UnsafeReleaseError(ValueError):
    """The release was refused: something visible to torch can still read the storage."""


class PoisonedReadError(RuntimeError):
    """An op read a storage that was released (poison mode) earlier."""


POISON_ON = ("1", "true", "yes", "on")
POISON_OFF = ("", "0", "false", "no", "off")


def poison_enabled() -> bool:
    """Whether ``MEMKIT_POISON`` asks for poisoning instead of freeing.

    Allowed values (any case): ``1``, ``true``, ``yes``, ``on`` (poison); unset, empty, ``0``, ``false``,
    ``no``, ``off`` (free). Anything else is a ``ValueError`` listing them, not a silent "off".
    """
    value = os.environ.get(POISON_ENV, "").strip().lower()
    if value in POISON_ON:
        return True
    if value in POISON_OFF:
        return False
    raise ValueError(f"{POISON_ENV}={os.environ[POISON_ENV]!r} is not allowed; use one of "
                     f"{', '.join(POISON_ON)} (poison) or {', '.join(v for v in POISON_OFF if v)} or unset (free)")


# -- validation ------------------------------------------------------------------------------------------
def validate_tensor(t: Any, what: str = "t") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(t, torch.nn.Parameter):
        raise ValueError(f"{what} is a parameter {describe_tensor(t)}: its storage is the trained value; only "
                         "activations (non-leaf tensors or leaves that do not require grad) can be released")
    if type(t) is not torch.Tensor:
        raise TypeError(f"{what} must be a plain torch.Tensor, got the subclass {type(t).__name__}")
    if t.is_leaf and t.requires_grad:
        raise ValueError(f"{what} is a leaf that requires grad {describe_tensor(t)}: backward accumulates into it "
                         "(AccumulateGrad holds it); only activations can be released")
    if t.layout != torch.strided or t.is_nested or t.device.type == "meta":
        raise ValueError(f"{what} must be a strided tensor with storage, got layout={t.layout} on {t.device}")
    if t._is_view():
        kind = "a view" if t.is_contiguous() else "a non-contiguous view"
        raise ValueError(f"{what} is {kind} {describe_tensor(t)} of a tensor of shape {tuple(t._base.shape)} that "
                         "shares its storage; release the base tensor instead, once nothing reads it")


def describe_tensor(t: torch.Tensor) -> str:
    return f"(shape {tuple(t.shape)}, {str(t.dtype).replace('torch.', '')}, {t.device})"


def _as_tensors(outputs: Any) -> list[torch.Tensor]:
    if outputs is None:
        return []
    return list(iter_tensors(outputs))


def is_released(t: torch.Tensor) -> bool:
    """Whether ``t`` needs storage but has none (its storage was resized to 0 bytes)."""
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


# -- the safety check ------------------------------------------------------------------------------------
@dataclass
class _Save:
    node: str
    name: str
    metadata_only: bool


def _counts(t: torch.Tensor) -> tuple[int, int]:
    """(other owners of the storage, other owners of t's TensorImpl), both 0 when t owns both alone."""
    return storage_use_count(t) - 2, t._use_count() - 1  # minus t's TensorImpl and the Python storage object


def _walk(roots: Iterable[Any], min_seq: int | None) -> Iterator[Any]:
    """Nodes reachable from ``roots`` whose sequence number is ``>= min_seq`` (created after t's producer)."""
    seen: set[int] = set()
    stack = [r for r in roots if r is not None]
    visited = 0
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "AccumulateGrad":
            continue
        if min_seq is not None and node._sequence_nr() < min_seq:
            continue
        visited += 1
        if visited > _MAX_NODES:
            raise UnsafeReleaseError(f"the autograd graph reachable from the outputs has more than {_MAX_NODES} "
                                     "nodes created after the tensor; too large to verify (pass check=False)")
        yield node
        stack.extend(n for n, _ in node.next_functions if n is not None)


def _saved_entries(node: Any) -> Iterator[tuple[str, Any]]:
    """``(name, raw)`` for what ``node`` keeps for backward; raw is a SavedTensor or a ctx attribute value."""
    raw_tensors = getattr(node, "_raw_saved_tensors", None)
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        try:
            for i, st in enumerate(raw_tensors or ()):
                yield f"saved_tensors[{i}]", st
        except RuntimeError:  # freed after backward
            pass
        for name, value in vars(node).items():
            yield f"ctx.{name}", value
        return
    for name in dir(node):
        if not name.startswith("_raw_saved_"):
            continue
        try:
            raw = getattr(node, name)
        except RuntimeError:  # freed after backward
            continue
        items = raw if isinstance(raw, (list, tuple)) else [raw]
        for st in items:
            yield name[len("_raw_saved_"):], st


def _find_saves(t: torch.Tensor, roots: list[Any], min_seq: int | None) -> list[_Save]:
    """Saves of t's storage among the nodes between t and roots (hook-packed ones show in the counts)."""
    key = storage_key(t)
    saves: list[_Save] = []
    for node in _walk(roots, min_seq):
        cls = type(node).__name__
        for name, raw in _saved_entries(node):
            if isinstance(raw, torch._C._autograd.SavedTensor):
                try:
                    data = raw.data
                except RuntimeError:
                    continue
            else:
                data = raw
            if any(has_storage(x) and storage_key(x) == key for x in iter_tensors(data)):
                saves.append(_Save(cls, name, (cls, name) in METADATA_ONLY_SAVES))
    return saves


def verify_release(
    t: torch.Tensor, outputs: Any = None, *, min_seq: int | None = None, held_by: Any = ()
) -> list[str]:
    """Reasons why releasing ``t`` now is unsafe (empty when it is safe); see the module docstring.

    Args:
        t: the tensor to release (validated as in :func:`release_storage`).
        outputs: tensors computed by ``t``'s consumers; the graph between them and ``t`` is searched.
        min_seq: lower bound on the autograd sequence number of ``t``'s consumers (used when ``t`` has no
            ``grad_fn``); default: ``t.grad_fn``'s own sequence number.
        held_by: an object (a list, a queue entry), or a tuple of them, that holds ``t`` and is known to read
            only its metadata (a schedule's list of stage outputs kept for a stage-wise backward).
    """
    validate_tensor(t)
    outs = _as_tensors(outputs)
    key = storage_key(t)
    reasons: list[str] = []
    for i, o in enumerate(outs):
        if has_storage(o) and storage_key(o) == key:
            what = "is the tensor itself" if o is t else "shares its storage"
            reasons.append(f"output {i} of its consumers {what} (the consumer returned its input or a view of it, "
                           "as an exchange does with expert parallelism off), so later stages still read it")
    sharers, holders = _counts(t)
    if t.grad_fn is not None:
        min_seq = t.grad_fn._sequence_nr()
    roots = [t.grad_fn, *(o.grad_fn for o in outs)]
    saves = _find_saves(t, roots, min_seq) if (sharers or holders or outs) else []
    readers = [s for s in saves if not s.metadata_only]
    for s in readers:
        reasons.append(f"it is saved for backward by {s.node} ({s.name}), which reads it")
    # a saved_tensors_hooks pack is opaque, but whatever it kept of t shows in the counts: t itself or a
    # container of it (Python references), a view or .detach() (storage owners), the storage object
    unexplained = sharers + holders - len(saves)
    if unexplained > 0 and not readers:
        if sharers > 0:
            reasons.append(f"its storage is shared by {sharers} other tensor(s) (a view, a .detach(), an alias "
                           "made by an exchange) that may still be read")
        else:
            reasons.append(f"{holders} reference(s) to it are held outside Python (an autograd node that saved it, "
                           "a view's base pointer, a communication work handle that is still referenced); pass "
                           "outputs= so the nodes that saved it can be inspected")
    if not reasons:
        reasons += _python_holders(t, held_by)
    if not reasons and storage_object_references(t) > 0:
        reasons.append("its UntypedStorage object is referenced from Python (a saved_tensors_hooks pack or a "
                       "variable kept t.untyped_storage()), so it may be read later")
    return reasons


def holders_tuple(held_by: Any) -> tuple:
    """``held_by`` as a tuple of holders: a tuple lists several; anything else (a list, a dict) is one."""
    return held_by if isinstance(held_by, tuple) else (held_by,)


def _python_holders(t: torch.Tensor, held_by: Any) -> list[str]:
    """A reason naming what holds ``t``'s Python object besides the running frames (empty when nothing does)."""
    held_by = holders_tuple(held_by)
    extra = unexplained_references(t, held_by=held_by)
    if extra <= 0:
        return []
    rows = []
    if NAME_HOLDERS:
        frames = caller_frames()
        # a running script's (or doctest's) globals are its frame's locals: the caller's own, not a holder
        own = _script_globals(frames, t)
        ignore = [*held_by, *frames]
        frames = None
        try:
            report = find_referrers(t, min_bytes=0, ignore=ignore, max_holders=4, max_depth=3)
        finally:
            ignore.clear()  # it holds this very frame: no cycle may keep t alive after a refusal
        rows = [r for r in report if r.holder != "(no Python holder)" and r.path not in own]
    named = "; ".join(f"{r.path} [{r.holder}]" for r in rows[:3])
    where = (f"held by {named}" if named else "held where Python cannot see it: a saved_tensors_hooks pack "
             "(torch.autograd.graph.save_on_cpu packs a CPU tensor itself), a C++ extension, or a temporary "
             "of a call in progress (a loop over a list of tensors: pop them from the list instead)")
    return [f"{extra} other Python reference(s) to the tensor may read it later: {where}"]


def _script_globals(frames: list[Any], t: torch.Tensor) -> set[str]:
    """``module NAME.var`` paths of ``t`` in the namespaces of running module-level frames (plain loops: a
    comprehension would capture ``t`` in a cell of the caller)."""
    paths = set()
    for f in frames:
        if not f.f_code.co_flags & CO_OPTIMIZED:
            for k, v in f.f_locals.items():
                if v is t:
                    paths.add(f"module {f.f_globals.get('__name__')}.{k}")
    return paths


# -- poisoning -------------------------------------------------------------------------------------------
@dataclass
class _PoisonEntry:
    ref: weakref.ref
    site: str
    what: str


_POISONED: dict[int, _PoisonEntry] = {}
_METADATA_OPS = frozenset(
    {
        "aten::detach", "aten::empty_like", "aten::zeros_like", "aten::ones_like", "aten::full_like",
        "aten::new_empty", "aten::new_empty_strided", "aten::new_zeros", "aten::new_ones", "aten::new_full",
        "aten::sym_size", "aten::sym_stride", "aten::sym_numel", "aten::sym_storage_offset", "aten::size",
        "aten::stride", "aten::is_same_size", "aten::_has_compatible_shallow_copy_type", "aten::set_",
    }
)


def call_site() -> str:
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = frame.filename.replace("\\", "/")
        if path.endswith(_OWN_FILES) or "/torch/" in path or path.endswith("contextlib.py"):
            continue
        return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "<unknown>"


def _forget(key: int) -> None:
    _POISONED.pop(key, None)


def _poison(t: torch.Tensor, site: str) -> None:
    storage = t.untyped_storage()
    key = storage_key(storage)
    _POISONED.pop(key, None)  # a poisoned storage re-poisoned: not a read
    storage.fill_(POISON_BYTE)
    _POISONED[key] = _PoisonEntry(weakref.ref(storage, lambda _r, key=key: _forget(key)), site, describe_tensor(t))


def _check_poisoned(tensors: Iterable[torch.Tensor], what: str) -> None:
    for x in tensors:
        if not has_storage(x):
            continue
        entry = _POISONED.get(storage_key(x))
        if entry is not None and entry.ref() is not None:
            raise PoisonedReadError(
                f"{what} read a tensor {entry.what} whose storage was released at {entry.site}; something still "
                "reads it after that point (poison mode: the storage was filled with a sentinel instead of freed)"
            )


class _PoisonGuard(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _POISONED and not func.is_view and func._schema.name not in _METADATA_OPS:
            _check_poisoned(iter_tensors((args, kwargs)), str(func))
        return func(*args, **kwargs)


#: Tensor methods that read the data without an ATen op (``numpy`` shares the memory, ``tolist`` copies it
#: in C); ``item`` is an op but is checked here too, before any dispatch.
_HOST_READS = frozenset({torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__array__})


class _PoisonHostReads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _POISONED and func in _HOST_READS:
            _check_poisoned(iter_tensors((args, kwargs)), f"Tensor.{getattr(func, '__name__', func)}()")
        return func(*args, **kwargs)


@contextmanager
def poison_guard() -> Iterator[None]:
    """Raise :class:`PoisonedReadError` when an op (forward or backward) reads a poisoned storage.

    Reads that bypass ATen ops are caught too: ``.numpy()``, ``.tolist()``, ``.item()``. Debug only: every
    op inside the block pays a Python check. ``release_stage_boundaries`` enters it for you when
    poisoning is on.
    """
    with _PoisonHostReads(), _PoisonGuard():
        yield


# -- public entry point ----------------------------------------------------------------------------------
def free_storage(t: torch.Tensor, *, poison: bool, site: str) -> int:
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if poison:
        _poison(t, site)
        return nbytes
    storage.resize_(0)
    del storage
    note_storage_resized(t)
    return nbytes


def release_storage(
    t: torch.Tensor,
    *,
    check: bool = True,
    outputs: Any = None,
    poison: bool | None = None,
    min_seq: int | None = None,
    site: str | None = None,
    held_by: Any = (),
) -> int:
    """Free ``t``'s storage now (keep the tensor and its ``grad_fn``); return the bytes released.

    Args:
        t: an activation: not a parameter, not a leaf that requires grad, not a view.
        check: refuse (:class:`UnsafeReleaseError`) when torch can see a later reader (see module docs).
        outputs: the tensors ``t``'s consumers produced; the graph between them and ``t`` is searched for
            nodes that saved ``t``. Without them, a tensor that any node saved is refused.
        poison: fill the storage with the sentinel instead of freeing it (default: ``MEMKIT_POISON``).
        min_seq: lower bound on the consumers' autograd sequence numbers when ``t`` has no ``grad_fn``.
        site: where the release was requested, for poison messages (default: the caller's frame).
        held_by: containers or objects that hold ``t`` but read only its metadata (a schedule's list of
            stage outputs); their references do not refuse the release. You vouch for them.

    A tensor already released returns 0.
    """
    validate_tensor(t)
    if not isinstance(check, bool):
        raise TypeError(f"release_storage(check=...) must be a bool, got {type(check).__name__}")
    poison = poison_enabled() if poison is None else poison
    if is_released(t) or t.untyped_storage().nbytes() == 0:
        return 0
    if check:
        reasons = verify_release(t, outputs, min_seq=min_seq, held_by=held_by)
        if reasons:
            raise UnsafeReleaseError(f"release_storage refused for tensor {describe_tensor(t)}: " + "; ".join(reasons))
    return free_storage(t, poison=poison, site=site or call_site())
