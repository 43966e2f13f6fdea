"""Activation offload: what backward needs from the repeated blocks goes to host memory as it is produced and comes
back ahead of its use (pure torch)."""

from lightning_memkit.offload.activations import (
    OffloadHandle,
    OffloadStats,
    is_offloaded,
    offload_activations,
    offload_blocks,
)

__all__ = ["OffloadHandle", "OffloadStats", "is_offloaded", "offload_activations", "offload_blocks"]
