"""The public names of the memory core in one place: re-exported from ``measure``, ``release``, ``recompute``,
``loading`` and ``estimate``, where they live. Pure torch (never imports Lightning)."""

from lightning_memkit.estimate.step import MemoryEstimate, PhaseEstimate, estimate_training_memory
from lightning_memkit.loading.allocator_warmup import WarmupDecision, guard_allocator_warmup, warmup_decision
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
from lightning_memkit.measure.saved_tensors import SavedTensorReport, SavedTensorRow, profile_saved_tensors
from lightning_memkit.recompute.activation_recompute import (
    RecomputeHandle,
    checkpoint_modules,
    is_checkpointed,
    repeated_blocks,
    select_modules,
)
from lightning_memkit.recompute.plan import CheckpointPlan, plan_checkpointing
from lightning_memkit.release.deferred_free import DeferredFree
from lightning_memkit.release.phases import empty_device_cache, release_optimizer_state
from lightning_memkit.release.referrers import Referrer, ReferrerReport, find_referrers
from lightning_memkit.release.stage_boundary import (
    BoundaryStats,
    release_stage_boundaries,
    stage_boundaries_enabled,
    stage_boundary,
)
from lightning_memkit.release.storage_release import (
    PoisonedReadError,
    UnsafeReleaseError,
    poison_guard,
    release_storage,
)

__all__ = [
    "release_optimizer_state",
    "estimate_training_memory",
    "MemoryEstimate",
    "PhaseEstimate",
    "find_referrers",
    "empty_device_cache",
    "Referrer",
    "ReferrerReport",
    "plan_checkpointing",
    "CheckpointPlan",
    "checkpoint_modules",
    "select_modules",
    "is_checkpointed",
    "repeated_blocks",
    "RecomputeHandle",
    "release_storage",
    "UnsafeReleaseError",
    "PoisonedReadError",
    "poison_guard",
    "DeferredFree",
    "stage_boundary",
    "release_stage_boundaries",
    "stage_boundaries_enabled",
    "BoundaryStats",
    "warmup_decision",
    "WarmupDecision",
    "guard_allocator_warmup",
    "LivePeak",
    "HostRSS",
    "MemoryReport",
    "current_rss_bytes",
    "DeviceBytes",
    "active_device_index",
    "device_total_memory",
    "effective_device_memory",
    "free_device_memory",
    "memory_fraction",
    "resolve_device",
    "profile_saved_tensors",
    "SavedTensorReport",
    "SavedTensorRow",
]
