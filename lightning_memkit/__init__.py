"""lightning_memkit: Lightning callbacks, a precision plugin and a pipeline strategy that cut peak memory.

Importing the package registers ``strategy="memkit_pipeline"`` with Lightning (once).
"""

from lightning_memkit.loading import dequantize_mxfp4, load_mxfp4_into, stream_dequantize
from lightning_memkit.memory import (
    DeferredFree,
    LivePeak,
    SavedTensorReport,
    active_device_index,
    device_total_memory,
    effective_device_memory,
    empty_device_cache,
    find_referrers,
    guard_allocator_warmup,
    profile_saved_tensors,
    release_optimizer_state,
    release_storage,
    warmup_decision,
)
from lightning_memkit.ops import cross_entropy, linear_cross_entropy, lm_head_loss, padded_index_gather
from lightning_memkit.pipeline import LayerCost, Partition, partition_layers

__version__ = "0.1.0"
__all__ = [
    "DeferredFree",
    "LayerCost",
    "LivePeak",
    "Partition",
    "SavedTensorReport",
    "__version__",
    "active_device_index",
    "cross_entropy",
    "dequantize_mxfp4",
    "device_total_memory",
    "effective_device_memory",
    "empty_device_cache",
    "find_referrers",
    "guard_allocator_warmup",
    "linear_cross_entropy",
    "lm_head_loss",
    "load_mxfp4_into",
    "padded_index_gather",
    "partition_layers",
    "profile_saved_tensors",
    "release_optimizer_state",
    "release_storage",
    "stream_dequantize",
    "warmup_decision",
]


try:  # the Lightning adapters; without Lightning the pure-torch core above still works
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_memkit.callbacks import (
        ActivationCheckpointing,
        AllocatorWarmupGuard,
        PeakMemoryMonitor,
        PhaseMemoryRelease,
        SavedTensorProfiler,
        StageBoundaryRelease,
    )
    from lightning_memkit.plugins import NoSaveBitsandbytesPrecision
    from lightning_memkit.strategies import MemkitPipelineStrategy
except ImportError:
    pass
else:
    # `Trainer(strategy="memkit_pipeline")`; registering again on a second import is harmless
    MemkitPipelineStrategy.register_strategies(StrategyRegistry)
    __all__ += [
        "ActivationCheckpointing",
        "AllocatorWarmupGuard",
        "MemkitPipelineStrategy",
        "NoSaveBitsandbytesPrecision",
        "PeakMemoryMonitor",
        "PhaseMemoryRelease",
        "SavedTensorProfiler",
        "StageBoundaryRelease",
    ]
