"""Count the bytes of tensor storage created inside a block, per device, with the high-water mark.

``LivePeak`` watches every ATen op through a :class:`~torch.utils._python_dispatch.TorchDispatchMode`.
Each storage that an op returns and that none of its inputs owned is a new allocation: its bytes are
added to the live count and a weak reference subtracts them again when the storage dies. The count
is exact on every device for the storages torch allocates through ops (what the caching allocator
adds on CUDA is cross-checked with ``torch.cuda.max_memory_allocated``). Storages that existed
before the block (parameters, inputs) are never counted, even when ops write into them in place.

``torch.compile``: a compiled function or module called inside the block is compiled as usual (the mode
is off while dynamo traces and compiles, so the compile's own work is not counted) and its compiled code
runs with the mode on, and stays compiled after the block. What the compiled code runs through the
dispatcher is counted: every op with the ``eager`` and ``aot_eager`` backends, so the count is the same
as for the uncompiled code. Inductor's kernels write into buffers that inductor allocates itself, outside
the dispatcher: LivePeak does not see those. For an inductor-compiled step, count with
:class:`~lightning_memkit.measure.allocator_peak.AllocatorPeak` (the allocator's own events) instead;
:func:`~lightning_memkit.measure.compiled.runs_compiled` tells whether a model runs compiled code.

Example::

    >>> import torch
    >>> from lightning_memkit.memory import LivePeak
    >>> with LivePeak() as lp:
    ...     a = torch.empty(1024, dtype=torch.float32)   # 4 KiB
    ...     b = torch.empty(2048, dtype=torch.uint8)     # 2 KiB
    ...     del a
    >>> lp.peak_bytes, lp.live_bytes
    (6144, 2048)
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from lightning_memkit.measure.allocator_peak import excluded_range
from lightning_memkit.measure.storage import has_storage, iter_op_tensors, storage_key, storage_of

__all__ = ["HOST", "LivePeak", "DeviceBytes", "device_key", "host_memory", "note_host", "note_storage_resized",
           "unmeasured"]

HOST = "host"  # the key of the bytes offloaded to host memory (pinned or not), counted apart from every device
_ACTIVE: list[LivePeak] = []  # trackers currently inside their block, innermost last
_STATE = threading.local()  # .host: the CPU storages created now are host memory (inside host_memory())


@contextlib.contextmanager
def host_memory() -> Iterator[None]:
    """CPU storages created inside the block are host memory: trackers count them under :data:`HOST`, apart from
    the device bytes (``peak_bytes``), as offloading moves bytes rather than hiding them.

    Example (a 4 KiB copy offloaded from a "device" that is the CPU itself)::

        >>> import torch
        >>> with LivePeak() as lp:
        ...     on_device = torch.ones(1024)
        ...     with host_memory():
        ...         on_host = on_device.to("cpu", copy=True)
        ...     del on_device
        >>> lp.live_bytes, lp.host_live_bytes, lp.host_peak_bytes, lp.peak_bytes
        (0, 4096, 4096, 4096)
    """
    before = getattr(_STATE, "host", False)
    _STATE.host = True
    try:
        yield
    finally:
        _STATE.host = before


def note_host(t: torch.Tensor) -> None:
    """Tell the active trackers that ``t``'s storage (made outside :func:`host_memory`) is host memory now."""
    for tracker in list(_ACTIVE):
        tracker._to_host(t)


def device_key(t: torch.Tensor) -> str:
    """Where a storage made now for ``t`` is counted: :data:`HOST` for a CPU tensor inside :func:`host_memory`, else
    ``str(t.device)``."""
    return HOST if t.device.type == "cpu" and getattr(_STATE, "host", False) else str(t.device)


def note_storage_resized(t: torch.Tensor) -> None:
    """Tell the active trackers that ``t``'s storage changed size outside an op (``resize_`` on it)."""
    for tracker in list(_ACTIVE):
        tracker._resync(t)


@contextlib.contextmanager
def unmeasured() -> Iterator[None]:
    """Peaks reached inside the block do not count for the trackers open around it (planning and probe runs).

    Each :class:`LivePeak` active at entry keeps its peak from before the block, raised only to the bytes
    still alive when the block ends (storages that the block created and kept do count), and its
    ``on_change`` sampler is not called inside the block. On CUDA the
    allocator's peak counters restart at the end of the block, so a ``max_memory_allocated`` read later
    does not see the block's peak either, and an open CPU
    :class:`~lightning_memkit.measure.allocator_peak.AllocatorPeak` skips the block's peaks in the same way.
    """
    saved = [(t, t.peak_bytes, t.host_peak_bytes, {d: b.peak for d, b in t.by_device.items()}, t.on_change)
             for t in _ACTIVE]
    for tracker in _ACTIVE:
        tracker.on_change = None  # a timeline sampler skips the block too
    try:
        with excluded_range():  # the same for the open CPU AllocatorPeak counters
            yield
    finally:
        for tracker, peak, host_peak, by_device, on_change in saved:
            with tracker._lock:
                tracker.on_change = on_change
                tracker.peak_bytes = max(peak, tracker.live_bytes)
                tracker.host_peak_bytes = max(host_peak, tracker.host_live_bytes)
                for name, d in tracker.by_device.items():
                    d.peak = max(by_device.get(name, 0), d.live)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(i)


@dataclass
class DeviceBytes:
    """Live and peak bytes on one device."""

    live: int = 0
    peak: int = 0


@dataclass
class StorageEntry:
    nbytes: int
    device: str
    tag: Any
    ref: weakref.ref = field(repr=False)


class _Mode(TorchDispatchMode):
    def __init__(self, tracker: LivePeak):
        super().__init__()
        self.tracker = tracker

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Without this, dynamo meets a non-infra dispatch mode on the stack, refuses to compile and marks the
        # frame's code to be skipped for good: a model first called under LivePeak would never compile. With it,
        # torch.compile traces and compiles with the mode off and runs the compiled code with the mode on.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_inference_mode_enabled():
            # without autograd keys a composite op (F.cross_entropy's cross_entropy_loss) reaches the mode whole and
            # allocates its intermediates below it: run its decomposition with the mode on, as FakeTensorMode does
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        inputs = set()
        for t in iter_op_tensors(args):
            if has_storage(t):
                inputs.add(storage_key(t))
        for t in iter_op_tensors(kwargs.values()):
            if has_storage(t):
                inputs.add(storage_key(t))
        out = func(*args, **kwargs)
        self.tracker._observe(out, inputs)
        return out


def _leave_mode(mode: TorchDispatchMode | None, exc: tuple) -> None:
    """Pop ``mode`` even when modes entered after it are still open (hooks may close out of order).

    Modes above it are stepped out of and entered again, so they keep counting. A mode that is no
    longer on the stack (someone else popped it) is left alone.
    """
    stack = _get_current_dispatch_mode_stack()
    if mode is None or not any(m is mode for m in stack):
        return
    above = []
    while stack[-1] is not mode:
        top = stack.pop()
        TorchDispatchMode.__exit__(top, None, None, None)
        above.append(top)
    try:
        mode.__exit__(*exc)
    finally:
        for top in reversed(above):
            TorchDispatchMode.__enter__(top)


class LivePeak:
    """Context manager: live and peak bytes of the storages created while it is active.

    Entered under a ``FakeTensorMode`` it counts fake storages (their sizes: an estimate); entered outside one it
    counts real storages only, so a fake-tensor estimate run inside the block (``MemoryBudget``'s planning) adds
    nothing.

    Attributes (readable inside and after the block):
        peak_bytes: the highest total of live bytes seen (all devices together).
        live_bytes: bytes of storages created in the block and still alive now.
        by_device: ``{"cpu": DeviceBytes(live, peak), "cuda:0": ...}``; offloaded bytes (:func:`host_memory`,
            :func:`note_host`) under ``"host"``.
        host_live_bytes, host_peak_bytes: the bytes in host memory (offloaded), live now and at their highest;
            never part of ``live_bytes`` and ``peak_bytes``, which count device bytes.
        cuda_peak_delta: on CUDA, ``max_memory_allocated`` during the block minus the bytes allocated
            at entry, per device (``None`` elsewhere); a cross-check that includes kernel workspaces.
        on_change: optional callable ``(device, live_bytes_on_device)`` called after every change of the
            count (a timeline sampler); ``None`` by default.

    Args:
        tag: optional callable called with no arguments at each allocation; its result is stored with
            the storage and returned by :meth:`live_storages` (used to attribute bytes to modules).
    """

    def __init__(self, tag: Callable[[], Any] | None = None):
        if tag is not None and not callable(tag):
            raise TypeError(f"LivePeak(tag=...) must be callable or None, got {type(tag).__name__}")
        self._tag = tag
        self._entries: dict[int, StorageEntry] = {}
        self._lock = threading.RLock()
        self._mode: _Mode | None = None
        self._cuda_start: dict[int, int] = {}
        self.by_device: dict[str, DeviceBytes] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.host_live_bytes = 0
        self.host_peak_bytes = 0
        self.cuda_peak_delta: dict[str, int] | None = None
        self.on_change: Callable[[str, int], None] | None = None
        self._counts_fake = False

    # -- context -----------------------------------------------------------------------------------
    def __enter__(self) -> LivePeak:
        if self._mode is not None:
            raise RuntimeError("LivePeak is not re-entrant: use a new LivePeak for a nested block")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i in range(torch.cuda.device_count()):
                self._cuda_start[i] = torch.cuda.memory_allocated(i)
                torch.cuda.reset_peak_memory_stats(i)
        # entered under a fake mode, it counts fake storages (an estimate); else only real ones: a fake tensor of an
        # estimate run inside the block takes no memory
        self._counts_fake = any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())
        self._mode = _Mode(self)
        self._mode.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        mode, self._mode = self._mode, None
        try:
            _leave_mode(mode, exc)
        finally:
            _ACTIVE[:] = [t for t in _ACTIVE if t is not self]
            if self._cuda_start:
                self.cuda_peak_delta = {
                    f"cuda:{i}": torch.cuda.max_memory_allocated(i) - start
                    for i, start in self._cuda_start.items()
                }

    # -- queries -----------------------------------------------------------------------------------
    def live_storages(self) -> list[tuple[int, int, str, Any]]:
        """``(key, nbytes, device, tag)`` for each storage created in the block and still alive."""
        with self._lock:
            return [(k, e.nbytes, e.device, e.tag) for k, e in self._entries.items()]

    def is_tracked(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage was created in the block (and is still alive)."""
        return has_storage(t) and storage_key(t) in self._entries

    def track(self, tensors: Iterable[torch.Tensor]) -> int:
        """Count the storages of ``tensors`` made before the block (weights, optimizer state, a batch) as if made
        in it: they add to the live bytes now and leave them when they are freed. Already tracked storages, and
        tensors without storage, are skipped; returns the bytes added.

        Example::

            >>> w = torch.zeros(256)
            >>> with LivePeak() as lp:
            ...     lp.track([w, w[:8]])   # one storage of 1 KiB, counted once
            ...     del w
            1024
            >>> lp.live_bytes, lp.peak_bytes
            (0, 1024)
        """
        before = self.live_bytes
        for t in tensors:
            if isinstance(t, torch.Tensor) and has_storage(t) and (self._counts_fake or not isinstance(t, FakeTensor)):
                key = storage_key(t)
                if key not in self._entries:
                    self._add(t, key)
        return self.live_bytes - before

    def refresh_sizes(self) -> int:
        """Re-read the size of every tracked storage and return the change in live bytes.

        Storages resized outside an op (``untyped_storage().resize_(0)``, as FSDP frees its gathered
        parameters) are otherwise still counted at their old size. A shrink never lowers the peak.
        """
        with self._lock:
            before = self.live_bytes
            for entry in list(self._entries.values()):
                storage = entry.ref()
                if storage is None:
                    continue
                delta, entry.nbytes = storage.nbytes() - entry.nbytes, storage.nbytes()
                if delta:
                    self._change(entry.device, delta)
            return self.live_bytes - before

    def reset_peak(self) -> None:
        """Start a new high-water mark from the bytes alive now."""
        with self._lock:
            self.peak_bytes = self.live_bytes
            self.host_peak_bytes = self.host_live_bytes
            for d in self.by_device.values():
                d.peak = d.live

    def __repr__(self) -> str:
        return f"LivePeak(peak_bytes={self.peak_bytes}, live_bytes={self.live_bytes})"

    # -- bookkeeping -------------------------------------------------------------------------------
    def _observe(self, out: Any, inputs: set[int]) -> None:
        for t in iter_op_tensors(out if isinstance(out, (list, tuple)) else (out,)):
            if not has_storage(t) or (isinstance(t, FakeTensor) and not self._counts_fake):
                continue
            key = storage_key(t)
            if key in inputs:
                if key in self._entries:
                    self._resync(t)  # in-place resize of a storage we track
                continue
            if key in self._entries:
                continue
            self._add(t, key)

    def _add(self, t: torch.Tensor, key: int) -> None:
        storage = storage_of(t)
        nbytes = storage.nbytes()
        device = device_key(t)
        tag = self._tag() if self._tag is not None else None
        ref = weakref.ref(storage, lambda _r, key=key: self._remove(key))
        with self._lock:
            self._entries[key] = StorageEntry(nbytes, device, tag, ref)
            self._change(device, nbytes)

    def _remove(self, key: int) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._change(entry.device, -entry.nbytes)

    def _resync(self, t: torch.Tensor) -> None:
        if not has_storage(t):
            return
        with self._lock:
            entry = self._entries.get(storage_key(t))
            if entry is None:
                return
            nbytes = storage_of(t).nbytes()
            delta, entry.nbytes = nbytes - entry.nbytes, nbytes
            self._change(entry.device, delta)

    def on_host(self, t: torch.Tensor) -> bool:
        """Whether this tracker counts ``t``'s storage as host memory."""
        entry = self._entries.get(storage_key(t)) if has_storage(t) else None
        return entry is not None and entry.device == HOST

    def _to_host(self, t: torch.Tensor) -> None:
        with self._lock:
            entry = self._entries.get(storage_key(t)) if has_storage(t) else None
            if entry is None or entry.device == HOST:
                return
            self._change(entry.device, -entry.nbytes)
            entry.device = HOST
            self._change(HOST, entry.nbytes)

    def _change(self, device: str, delta: int) -> None:
        d = self.by_device.setdefault(device, DeviceBytes())
        d.live += delta
        d.peak = max(d.peak, d.live)
        if device == HOST:
            self.host_live_bytes += delta
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_live_bytes)
        else:
            self.live_bytes += delta
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self.on_change is not None:
            self.on_change(device, d.live)
