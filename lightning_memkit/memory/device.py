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
