"""The strategies: ``memkit_pipeline``, a thin Lightning adapter over :mod:`lightning_memkit.pipeline`, and
``memkit_fsdp2``, Lightning's ``ModelParallelStrategy`` sharding each repeated block with
:mod:`lightning_memkit.sharding`."""

from lightning_memkit.strategies.fsdp2 import MemkitFSDP2Strategy
from lightning_memkit.strategies.pipeline import MemkitPipelineStrategy, load_pipeline_state_dict  # noqa: E402

__all__ = ["MemkitFSDP2Strategy", "MemkitPipelineStrategy", "load_pipeline_state_dict"]
