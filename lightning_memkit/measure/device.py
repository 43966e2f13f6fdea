"""Which accelerator is active, how much memory it has, and how much this process may use.

Example::

    >>> from lightning_memkit.memory import active_device_index, effective_device_memory
    >>> dev = effective_device_memory("cpu")  # cgroup limit or physical memory, in bytes
    >>> dev > 0
    True
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = [
    "resolve_device",
    "active_device_index",
    "device_total_memory",
    "effective_device_memory",
    "memory_fraction",
    "free_device_memory",
]

_KNOWN = ("cpu", "cuda", "xpu", "mps")


def resolve_device(device: torch.device | str | int | None = None) -> torch.device:
    """Turn ``None`` (the active accelerator, else cpu), an index, a string or a device into a device.

    Bare accelerator names get the active index (``"cuda"`` -> ``cuda:<current_device()>``): nothing
    here assumes device 0.
    """
    if device is None:
        for kind in ("cuda", "xpu"):
            mod = getattr(torch, kind, None)
            if mod is not None and mod.is_available():
                return torch.device(kind, mod.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device index must be >= 0, got {device}")
        return torch.device("cuda", device)
    if isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError as err:
            raise ValueError(
                f"device={device!r} is not a device string; allowed: {', '.join(_KNOWN)} "
                "optionally with an index such as 'cuda:1'"
            ) from err
    elif isinstance(device, torch.device):
        dev = device
    else:
        raise TypeError(f"device must be None, int, str or torch.device, got {type(device).__name__}")
    if dev.type not in _KNOWN:
        raise ValueError(f"device={str(dev)!r} is not supported; allowed: {', '.join(_KNOWN)}")
    if dev.index is None and dev.type in ("cuda", "xpu"):
        mod = getattr(torch, dev.type)
        if mod.is_available():
            dev = torch.device(dev.type, mod.current_device())
    return dev


def active_device_index(device: torch.device | str | int | None = None) -> int | None:
    """Index of the active (or given) accelerator; ``None`` for cpu and mps."""
    dev = resolve_device(device)
    return dev.index if dev.type in ("cuda", "xpu") else None


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            return int(text)
    return None


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_total_memory(device: torch.device | str | int | None = None) -> int | None:
    """Total memory of the device in bytes, or ``None`` when it cannot be known.

    cuda/xpu: the card's total memory; mps: the recommended working set; cpu: the cgroup limit if one
    is set, else physical memory.
    """
    dev = resolve_device(device)
    if dev.type in ("cuda", "xpu"):
        mod = getattr(torch, dev.type)
        if not mod.is_available():
            return None
        return int(mod.get_device_properties(dev.index).total_memory)
    if dev.type == "mps":
        fn = getattr(torch.mps, "recommended_max_memory", None)
        return int(fn()) if fn is not None and torch.backends.mps.is_available() else None
    phys = _physical_memory()
    cg = _cgroup_limit()
    if phys is None:
        return cg
    return min(phys, cg) if cg is not None else phys


def memory_fraction(device: torch.device | str | int | None = None) -> float:
    """The per-process memory fraction set with ``torch.cuda.set_per_process_memory_fraction`` (1.0 if none)."""
    dev = resolve_device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return 1.0
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is None:
        return 1.0
    try:
        return float(getter(dev.index))
    except (RuntimeError, TypeError):
        return 1.0


def effective_device_memory(device: torch.device | str | int | None = None) -> int | None:
    """Memory this process may use on the device: total memory x the per-process fraction."""
    total = device_total_memory(device)
    if total is None:
        return None
    return int(total * memory_fraction(device))


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_free() -> int | None:
    limit = _cgroup_limit()
    if limit is None:
        return None
    for path in ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"):
        try:
            return max(0, limit - int(Path(path).read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


def free_device_memory(device: torch.device | str | int | None = None) -> int | None:
    """Bytes a new allocation could still take on the device now, or ``None`` when it cannot be known.

    cuda: the driver's free memory plus what PyTorch's cache holds unused, within the per-process
    fraction; cpu: ``MemAvailable`` of ``/proc/meminfo``, and no more than the cgroup leaves.

    Example::

        >>> free_device_memory("cpu") is None or free_device_memory("cpu") > 0
        True
    """
    dev = resolve_device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info(dev)
        allocated = torch.cuda.memory_allocated(dev)
        cached = torch.cuda.memory_reserved(dev) - allocated
        allowed = effective_device_memory(dev)
        budget = free + cached
        return int(min(budget, allowed - allocated)) if allowed is not None else int(budget)
    if dev.type != "cpu":
        return None
    values = [v for v in (_meminfo_available(), _cgroup_free()) if v is not None]
    return min(values) if values else None
