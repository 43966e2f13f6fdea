"""Giving memory back, safely: a storage is freed only when nothing else can read it (its referrers
found and explained), at stage boundaries, after a CUDA event (deferred), or between phases. Pure torch."""

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
    "BoundaryStats", "DeferredFree", "PoisonedReadError", "Referrer", "ReferrerReport", "UnsafeReleaseError",
    "empty_device_cache", "find_referrers", "poison_guard", "release_optimizer_state", "release_stage_boundaries",
    "release_storage", "stage_boundaries_enabled", "stage_boundary",
]
