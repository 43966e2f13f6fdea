"""Measuring memory, in bytes: live tensor storage (exact on CPU), allocator peaks, host RSS, the tensors
autograd saves, device queries, and the report that shows them. Pure torch (never imports Lightning)."""

from lightning_memkit.measure.allocator_peak import AllocatorPeak
from lightning_memkit.measure.compiled import compiled_parts, runs_compiled
from lightning_memkit.measure.device import (
    active_device_index,
    device_total_memory,
    effective_device_memory,
    free_device_memory,
    memory_fraction,
    resolve_device,
)
from lightning_memkit.measure.host_rss import HostRSS, MemoryReport, current_rss_bytes
from lightning_memkit.measure.live_peak import DeviceBytes, LivePeak
from lightning_memkit.measure.report import memory_effects, static_memory_table
from lightning_memkit.measure.saved_tensors import SavedTensorReport, SavedTensorRow, profile_saved_tensors
from lightning_memkit.measure.storage import format_bytes, storage_key, storage_of, unique_storage_bytes

__all__ = [
    "AllocatorPeak", "DeviceBytes", "HostRSS", "LivePeak", "MemoryReport", "SavedTensorReport", "SavedTensorRow",
    "active_device_index", "compiled_parts", "current_rss_bytes", "device_total_memory", "effective_device_memory",
    "format_bytes", "free_device_memory", "memory_effects", "memory_fraction", "profile_saved_tensors",
    "resolve_device", "runs_compiled", "static_memory_table", "storage_key", "storage_of", "unique_storage_bytes",
]
