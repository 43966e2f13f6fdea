"""The peak of new bytes the allocator hands out while a block runs: also inside ``torch.compile``d code.

:class:`~lightning_memkit.memory.LivePeak` counts storages through a dispatch mode. Compiled code runs
under it (and stays compiled), but inductor's kernels write into buffers that inductor allocates outside
the dispatcher, which no dispatch mode sees. :class:`AllocatorPeak` counts at the allocator instead: on
CUDA the ``max_memory_allocated`` delta; on CPU the allocation and free events of the CPU allocator,
recorded by ``torch.profiler`` with ``profile_memory=True`` (the buffers inductor's kernels allocate
included). Blocks allocated before the block and freed in it are not subtracted (the CPU allocator does
not know their size; it warns once), so, as with LivePeak, only what the block creates counts. On eager
CPU code both agree to the byte.

On CPU one profiler session runs at a time. A CPU ``AllocatorPeak`` entered while another is open stops
the outer one's session: the outer count would miss part of its block, so its ``complete`` becomes
``False`` and its ``peak_bytes`` ``None`` (never a partial number). Entering one while some other
``torch.profiler`` session runs raises ``RuntimeError``. Peaks reached inside
:func:`~lightning_memkit.measure.live_peak.unmeasured` do not count, as for LivePeak, and neither do
those of ``torch.compile``'s own work (tracing and compiling a graph, also a backward compiled at its
first run): what the compile keeps alive afterwards still counts.

Example::

    >>> import torch
    >>> from lightning_memkit.measure.allocator_peak import AllocatorPeak
    >>> with AllocatorPeak("cpu") as ap:
    ...     a = torch.empty(1024, dtype=torch.float32)   # 4 KiB
    ...     b = torch.empty(2048, dtype=torch.uint8)     # 2 KiB
    ...     del a
    >>> ap.peak_bytes
    6144
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["AllocatorPeak", "excluded_range"]

log = logging.getLogger(__name__)

_EXCLUDED = "memkit::unmeasured"  # record_function ranges whose peaks do not count
_ACTIVE: list[AllocatorPeak] = []  # CPU counters whose profiler session runs now


class AllocatorPeak:
    """Context manager: ``peak_bytes`` is the high-water mark of bytes allocated on ``device`` inside the block.

    ``device``: ``"cpu"`` or a CUDA device. ``complete`` is ``False`` (and ``peak_bytes`` ``None``) when a
    later CPU ``AllocatorPeak`` stopped this one's profiler session before the block ended.
    """

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"AllocatorPeak(device={str(self.device)!r}): only 'cpu' and 'cuda' devices are supported")
        self.peak_bytes: int | None = 0
        self.complete = True
        self._profiler: Any = None
        self._base = 0

    def __enter__(self) -> AllocatorPeak:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        for outer in list(_ACTIVE):
            outer._interrupt()
        if torch.autograd.profiler._is_profiler_enabled:
            raise RuntimeError(
                "AllocatorPeak('cpu') counts with torch.profiler's memory events, but another torch.profiler session "
                "is running (a Lightning profiler, for instance) and sessions cannot nest; stop it or measure "
                "without it"
            )
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()
        _ACTIVE.append(self)
        _watch_compiles(True)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        profiler, self._profiler = self._profiler, None
        if profiler is None:  # interrupted: the session is stopped already
            return
        _ACTIVE[:] = [c for c in _ACTIVE if c is not self]
        _watch_compiles(False)
        profiler.__exit__(*exc)
        if exc[0] is None:
            self.peak_bytes = _running_peak(profiler.profiler.kineto_results)

    def _interrupt(self) -> None:
        """Stop the session for a counter entered later: this count is incomplete and says so."""
        profiler, self._profiler = self._profiler, None
        _ACTIVE[:] = [c for c in _ACTIVE if c is not self]
        _watch_compiles(False)
        self.complete, self.peak_bytes = False, None
        log.debug("AllocatorPeak: a nested CPU AllocatorPeak stopped this one's profiler session")
        if profiler is not None:
            profiler.__exit__(None, None, None)


@contextlib.contextmanager
def excluded_range() -> Iterator[None]:
    """Mark the block for the open CPU counters: its peaks do not count (used by ``unmeasured``)."""
    if not _ACTIVE:
        yield
        return
    with torch.profiler.record_function(_EXCLUDED):
        yield


_open_compiles: list[Any] = []  # record_function ranges opened by a compile start, closed by its end


def _compile_started(_args: Any) -> None:
    if _ACTIVE:
        _open_compiles.append(torch.profiler.record_function(_EXCLUDED).__enter__())


def _compile_ended(_args: Any) -> None:
    if _open_compiles:
        _open_compiles.pop().__exit__(None, None, None)


def _watch_compiles(on: bool) -> None:
    """Mark dynamo's compiles as excluded ranges while a CPU counter is open (dynamo's compile callbacks).

    Without dynamo imported nothing is compiled (``torch.compile(...)`` imports it before its first call):
    importing it here would cost seconds for nothing.
    """
    if "torch._dynamo" not in sys.modules:
        return
    from torch._dynamo.callback import callback_handler

    registered = _compile_started in callback_handler.start_callbacks
    if on and not registered:
        callback_handler.register_start_callback(_compile_started)
        callback_handler.register_end_callback(_compile_ended)
    elif not on and registered and not _ACTIVE:
        callback_handler.remove_start_callback(_compile_started)
        if _compile_ended in callback_handler.end_callbacks:
            callback_handler.remove_end_callback(_compile_ended)


def _running_peak(result: Any) -> int:
    """The highest running sum of the CPU allocator's events in ``result`` (allocations +, frees -).

    A free counts only when its block was allocated in this session: the profiler also reports, with their
    size, frees of blocks that an earlier session saw allocated, and those existed before the block.
    Inside a ``memkit::unmeasured`` range the sum moves but the peak does not; at the range's end the peak
    is raised to the bytes still alive then.
    """
    allocation = torch._C._profiler._EventType.Allocation
    memory, ranges = [], []
    stack = list(result.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == allocation:
            f = e.extra_fields
            if str(f.device).startswith("cpu"):
                memory.append((e.start_time_ns, 0, f.alloc_size, f.ptr))
        elif e.name == _EXCLUDED:
            ranges.append((e.start_time_ns, e.end_time_ns))
    points = sorted(memory + [(end, 1, 0, 0) for _, end in ranges])
    live = peak = 0
    mine: dict[int, int] = {}  # ptr -> bytes of the blocks allocated in this session and alive
    for t, kind, nbytes, ptr in points:
        if kind == 0 and nbytes > 0:
            mine[ptr] = mine.get(ptr, 0) + nbytes
            live += nbytes
        elif kind == 0 and ptr in mine:
            live -= mine.pop(ptr)
        inside = any(start <= t < end for start, end in ranges)
        if kind == 1 or not inside:
            peak = max(peak, live)
    return peak
