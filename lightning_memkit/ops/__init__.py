"""Memory-lean ops: fused cross-entropy, a padded row gather and no-save quantized matmuls (pure torch)."""

from lightning_memkit.ops import nosave_experts, nosave_matmul
from lightning_memkit.ops.cross_entropy import cross_entropy
from lightning_memkit.ops.linear_cross_entropy import linear_cross_entropy
from lightning_memkit.ops.lm_loss import lm_head_loss
from lightning_memkit.ops.padded_index_gather import padded_index_gather

__all__ = ["cross_entropy", "linear_cross_entropy", "lm_head_loss", "padded_index_gather", "nosave_matmul",
           "nosave_experts"]
