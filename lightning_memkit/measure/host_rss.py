"""Peak resident set size (RSS) of this process during a block, beside LivePeak's exact tensor bytes.

RSS is every page the process has resident: tensor storage, the interpreter and its libraries, the
allocator's cached pages, and the touched pages of memory-mapped files (a checkpoint read through
``mmap`` stays resident until it is unmapped). :class:`~lightning_memkit.memory.LivePeak` counts tensor
storage only, exactly; :class:`HostRSS` counts what the operating system charges the process.
:class:`MemoryReport` puts the two side by side.

How the peak is read (``HostRSS.method`` after the block):

- ``"vmhwm"``: the kernel's high-water mark ``VmHWM`` of ``/proc/self/status`` (Linux), exact, every thread
  included. The default (``method="auto"``) reads it when the block set a new peak for the process (the
  usual case for a model load), and changes nothing in the process. ``method="reset"`` makes it exact in
  every case by resetting the mark at entry (writing ``5`` to ``/proc/self/clear_refs``, Linux >= 4.0);
  that reset is process-wide: afterwards ``VmHWM`` and ``getrusage``'s ``ru_maxrss`` tell the peak since
  the reset. Trackers active around it keep their own peaks.
- ``"sampled"``: the block stayed below an earlier peak of the process (or there is no ``VmHWM``): the
  highest of the readings of the current RSS (``VmRSS``, or ``psutil`` off Linux) that a thread took every
  ``interval`` seconds, at entry and at exit; a spike shorter than the interval can be missed.
- ``"unavailable"``: neither ``/proc`` nor ``psutil``; the byte fields are ``None``.

Example::

    >>> import torch
    >>> from lightning_memkit.memory import HostRSS
    >>> with HostRSS() as rss:
    ...     x = torch.ones(2**24)          # 64 MiB, written: resident until the block ends
    >>> rss.method in ("vmhwm", "sampled", "unavailable")
    True
    >>> rss.method == "unavailable" or rss.increase_bytes >= 60 * 2**20
    True
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from lightning_memkit.common.validation import check_choice, check_number
from lightning_memkit.measure.storage import format_bytes

__all__ = ["HostRSS", "MemoryReport", "current_rss_bytes", "rss_high_water_bytes"]

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_METHODS = ("auto", "reset", "sampled")
_LOCK = threading.Lock()
_ACTIVE: list[HostRSS] = []  # trackers inside their block; folded before any high-water reset


def _status_bytes(key: str) -> int | None:
    """``VmRSS``/``VmHWM``/``RssFile``... of ``/proc/self/status`` in bytes; ``None`` where there is none."""
    try:
        with open(_STATUS, "rb") as f:
            for line in f:
                if line.startswith(key.encode() + b":"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except OSError:
        return None
    return None


def current_rss_bytes() -> int | None:
    """This process's resident set size now (``VmRSS``, else ``psutil``); ``None`` when neither is there."""
    rss = _status_bytes("VmRSS")
    if rss is not None:
        return rss
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


def rss_high_water_bytes() -> int | None:
    """The kernel's peak RSS of this process (``VmHWM``, Linux), since start or the last reset."""
    return _status_bytes("VmHWM")


def _reset_high_water() -> bool:
    """Reset ``VmHWM`` to the current RSS (``echo 5 > /proc/self/clear_refs``); ``False`` if refused."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class HostRSS:
    """Context manager: resident set size of this process at entry, at its peak and at exit (bytes).

    Args:
        method: ``"auto"`` (sample, and read ``VmHWM`` when the block set a new process peak), ``"reset"``
            (reset ``VmHWM`` at entry: exact always, process-wide; ``ValueError`` at entry where it cannot) or
            ``"sampled"`` (samples only); see the module docstring.
        interval: seconds between samples (> 0), for ``"auto"`` and ``"sampled"``.

    Attributes (after the block; ``None`` when ``method`` is ``"unavailable"``): ``start_bytes``,
    ``peak_bytes`` (>= both others), ``end_bytes``, ``increase_bytes`` (peak minus start) and ``method``.
    """

    def __init__(self, method: str = "auto", interval: float = 0.005):
        self.requested = check_choice(method, "method", _METHODS, owner="HostRSS")
        self.interval = check_number(interval, "interval", minimum=0, min_inclusive=False, owner="HostRSS")
        self.method: str | None = None
        self.start_bytes: int | None = None
        self.peak_bytes: int | None = None
        self.end_bytes: int | None = None
        self._hwm_start: int | None = None
        self._reset_seen = False  # a reset of VmHWM happened inside the block: later readings are within it
        self._stop = threading.Event()
        self._fold_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def increase_bytes(self) -> int | None:
        """Peak minus start: what the block added at its worst."""
        return None if self.peak_bytes is None else self.peak_bytes - self.start_bytes

    def _fold(self, value: int | None) -> None:
        with self._fold_lock:  # the sampler thread and other trackers' entries fold too
            if value is not None and self.peak_bytes is not None:
                self.peak_bytes = max(self.peak_bytes, value)

    def _fold_high_water(self, hwm: int | None) -> bool:
        """Fold ``VmHWM`` if it can only stem from inside the block; whether it did."""
        inside = hwm is not None and (self._reset_seen or (self._hwm_start is not None and hwm > self._hwm_start))
        if inside:
            self._fold(hwm)
        return inside

    def __enter__(self) -> HostRSS:
        if self.method is not None:
            raise RuntimeError("HostRSS is not re-entrant: use a new HostRSS for a nested block")
        with _LOCK:
            if self.requested == "reset":
                self._start_reset()
            else:
                self._hwm_start = rss_high_water_bytes()
                self.start_bytes = self.peak_bytes = current_rss_bytes()
                self.method = "unavailable" if self.start_bytes is None else "sampled"
            _ACTIVE.append(self)
        if self.method == "sampled":
            self._thread = threading.Thread(target=self._sample, name="memkit-host-rss", daemon=True)
            self._thread.start()
        return self

    def _start_reset(self) -> None:
        hwm = rss_high_water_bytes()
        if hwm is None or not _reset_high_water():
            raise ValueError(f"HostRSS(method='reset'): cannot reset the peak RSS here ({_CLEAR_REFS} is not "
                             "writable or there is no /proc/self/status); use method='auto' or 'sampled'")
        for other in _ACTIVE:  # the reset lowered VmHWM: the trackers around keep what it held
            other._fold_high_water(hwm)
            other._reset_seen = True
        self._reset_seen = True
        self.method = "vmhwm"
        self.start_bytes = self.peak_bytes = rss_high_water_bytes()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._fold(current_rss_bytes())

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        with _LOCK:
            _ACTIVE[:] = [t for t in _ACTIVE if t is not self]
            if self.method == "unavailable":
                return
            self.end_bytes = current_rss_bytes()
            self._fold(self.end_bytes)
            exact = self._fold_high_water(rss_high_water_bytes())
            if exact and self.requested != "sampled" and (self.requested == "reset" or not self._reset_seen):
                self.method = "vmhwm"

    def __repr__(self) -> str:
        return (f"HostRSS(method={self.method!r}, start_bytes={self.start_bytes}, peak_bytes={self.peak_bytes}, "
                f"end_bytes={self.end_bytes})")


@dataclass(frozen=True)
class MemoryReport:
    """Host RSS and tensor storage (LivePeak) of one block, side by side; ``str()`` is a readable summary.

    ``tensor_peak_bytes`` is LivePeak's peak over all devices and ``tensor_peak_by_device`` per device; the
    ``rss_*`` fields come from :class:`HostRSS` (``None`` where RSS could not be read). Example::

        >>> from lightning_memkit.memory import LivePeak, HostRSS, MemoryReport
        >>> with LivePeak() as lp, HostRSS() as rss:
        ...     pass
        >>> MemoryReport.of(lp, rss).tensor_peak_bytes
        0
    """

    tensor_peak_bytes: int
    rss_start_bytes: int | None
    rss_peak_bytes: int | None
    rss_end_bytes: int | None
    rss_method: str
    tensor_peak_by_device: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, live_peak, host_rss: HostRSS) -> MemoryReport:
        """From a finished :class:`~lightning_memkit.memory.LivePeak` and :class:`HostRSS`."""
        return cls(live_peak.peak_bytes, host_rss.start_bytes, host_rss.peak_bytes, host_rss.end_bytes,
                   host_rss.method or "unavailable", {d: b.peak for d, b in live_peak.by_device.items()})

    @property
    def rss_increase_bytes(self) -> int | None:
        """RSS peak minus RSS at entry."""
        return None if self.rss_peak_bytes is None else self.rss_peak_bytes - self.rss_start_bytes

    def __str__(self) -> str:
        devices = ", ".join(f"{format_bytes(b)} on {d}" for d, b in sorted(self.tensor_peak_by_device.items()))
        tensors = f"tensor storage peak {format_bytes(self.tensor_peak_bytes)}" + (f" ({devices})" if devices else "")
        if self.rss_peak_bytes is None:
            return f"{tensors}; host RSS unavailable on this platform"
        return (f"host RSS peak {format_bytes(self.rss_peak_bytes)} (+{format_bytes(self.rss_increase_bytes)} over "
                f"{format_bytes(self.rss_start_bytes)} at start, {self.rss_method}); {tensors} (LivePeak)")
