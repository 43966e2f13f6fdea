"""The pipeline strategy ``memkit_pipeline``: a thin Lightning adapter over :mod:`lightning_memkit.pipeline`."""

from lightning_memkit.strategies.pipeline import MemkitPipelineStrategy, load_pipeline_state_dict  # noqa: E402

__all__ = ["MemkitPipelineStrategy", "load_pipeline_state_dict"]
