"""Pure-torch memory accounting and release (never imports Lightning)."""

from lightning_memkit.memory.device import (
    active_device_index,
    device_total_memory,
    effective_device_memory,
    memory_fraction,
    resolve_device,
)
from lightning_memkit.memory.live_peak import DeviceBytes, LivePeak

__all__ = [
    "LivePeak",
    "DeviceBytes",
    "active_device_index",
    "device_total_memory",
    "effective_device_memory",
    "memory_fraction",
    "resolve_device",
]
