"""Parameters, gradients and optimizer state sharded over ranks with FSDP2 (``fully_shard``), each repeated block one
unit and the root one more; the fake process group a one-process estimate of a rank runs in; FSDP2's storage resizes
made visible to the byte counters (pure torch)."""

from lightning_memkit.sharding.fake_group import current_mesh, fake_mesh
from lightning_memkit.sharding.fully_shard import SHARDINGS, is_sharded, shard_model, visible_resizes

__all__ = ["SHARDINGS", "current_mesh", "fake_mesh", "is_sharded", "shard_model", "visible_resizes"]
