"""``strategy="memkit_fsdp2"``: Lightning's ``ModelParallelStrategy`` with every rank one data-parallel shard, the
module sharded for you (:func:`~lightning_memkit.sharding.shard_model`: each decoder layer, or repeated block, one
FSDP2 unit, then the module), after the precision plugin converted it (a QLoRA plugin quantizes the whole weights,
then their packed bytes shard). A ``configure_model`` that shards the module itself is kept as it is.

Example (two CPU processes, a LightningCLI config fragment)::

    trainer:
      accelerator: cpu
      devices: 2
      strategy:
        class_path: lightning_memkit.strategies.MemkitFSDP2Strategy
        init_args: {reshard_after_forward: true}

    >>> from lightning_memkit.strategies import MemkitFSDP2Strategy
    >>> MemkitFSDP2Strategy(reshard_after_forward=False).reshard_after_forward
    False
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout

from lightning_memkit.common.validation import check_bool

__all__ = ["MemkitFSDP2Strategy"]

_OWNER = "MemkitFSDP2Strategy"


class MemkitFSDP2Strategy(ModelParallelStrategy):
    """FSDP2 over every rank (a 1-D data-parallel mesh), each repeated block one unit.

    Args:
        reshard_after_forward: free each unit's gathered parameters after its forward (``False``: keep them until its
            backward: one all-gather per step, more memory).
        offload: parameters, gradients and optimizer state in host memory (FSDP2's ``CPUOffloadPolicy``).
        save_distributed_checkpoint, process_group_backend, timeout: as ``ModelParallelStrategy``'s.
    """

    strategy_name = "memkit_fsdp2"

    def __init__(self, reshard_after_forward: bool = True, offload: bool = False,
                 save_distributed_checkpoint: bool = True, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:
        check_bool(reshard_after_forward, "reshard_after_forward", owner=_OWNER)
        check_bool(offload, "offload", owner=_OWNER)
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.reshard_after_forward, self.offload = reshard_after_forward, offload
        self._resizes: Any = None

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every rank a shard: no tensor parallelism
        self._tensor_parallel_size = 1
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        """As ``ModelParallelStrategy.setup``, with the module converted by the precision plugin first and then
        sharded (unless its ``configure_model`` sharded it); no ``configure_model`` needed."""
        from lightning_memkit.sharding import is_sharded, visible_resizes

        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        if not is_sharded(self.model):
            self._shard(self.model)
        self.model_to_device()
        self.barrier()
        if self._resizes is None:  # LivePeak counts the gathered parameters FSDP2 allocates and frees in place
            self._resizes = visible_resizes()
            self._resizes.__enter__()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self.offload:  # offloaded: the state stays on the host
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard(self, module: Any) -> None:
        from lightning_memkit.hf.layers import decoder_layers
        from lightning_memkit.recompute.activation_recompute import repeated_blocks
        from lightning_memkit.recompute.blocks import choose_blocks
        from lightning_memkit.sharding import shard_model

        blocks = choose_blocks(module, "auto", owner=_OWNER, verb="shard", finders=(decoder_layers, repeated_blocks))
        shard_model(module, self.device_mesh["data_parallel"], blocks=[m for _, m in blocks],
                    reshard_after_forward=self.reshard_after_forward, offload=self.offload)

    def teardown(self) -> None:
        if self._resizes is not None:
            self._resizes.__exit__(None, None, None)
            self._resizes = None
        super().teardown()
