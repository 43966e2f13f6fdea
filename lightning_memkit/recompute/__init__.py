"""Activation recomputation: checkpoint chosen modules (full or selective), and plan which ones under a
byte budget from a measured profile. Pure torch."""

from lightning_memkit.recompute.activation_recompute import (
    SAVED_OPS,
    RecomputeHandle,
    checkpoint_modules,
    is_checkpointed,
    repeated_blocks,
    select_modules,
)
from lightning_memkit.recompute.plan import CheckpointPlan, plan_checkpointing

__all__ = ["SAVED_OPS", "CheckpointPlan", "RecomputeHandle", "checkpoint_modules", "is_checkpointed",
           "plan_checkpointing", "repeated_blocks", "select_modules"]
