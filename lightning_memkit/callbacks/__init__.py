"""Lightning callbacks, one feature each: when (which hook, which rank) to measure, cut or release memory; the
work itself is done by the core folders (``measure``, ``release``, ``recompute``, ``ops``, ``loading``)."""

from lightning_memkit import register_pipeline_strategy
from lightning_memkit.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_memkit.callbacks.activation_offloading import ActivationOffloading
from lightning_memkit.callbacks.allocator_warmup_guard import AllocatorWarmupGuard
from lightning_memkit.callbacks.fused_linear_cross_entropy import FusedLinearCrossEntropy
from lightning_memkit.callbacks.memory_budget import MemoryBudget
from lightning_memkit.callbacks.micro_batch_split import MicroBatchSplit
from lightning_memkit.callbacks.mxfp4_loading import MXFP4CheckpointLoader
from lightning_memkit.callbacks.offload_optimizer import OffloadOptimizer
from lightning_memkit.callbacks.optimizer_8bit import Optimizer8bit
from lightning_memkit.callbacks.optimizer_in_backward import OptimizerInBackward
from lightning_memkit.callbacks.peak_memory_monitor import PeakMemoryMonitor
from lightning_memkit.callbacks.phase_memory_release import PhaseMemoryRelease
from lightning_memkit.callbacks.saved_tensor_profiler import SavedTensorProfiler
from lightning_memkit.callbacks.stage_boundary_release import StageBoundaryRelease
from lightning_memkit.callbacks.tiled_mlp import TiledMLP

__all__ = [
    "ActivationCheckpointing",
    "ActivationOffloading",
    "PhaseMemoryRelease",
    "AllocatorWarmupGuard",
    "FusedLinearCrossEntropy",
    "MemoryBudget",
    "MicroBatchSplit",
    "MXFP4CheckpointLoader",
    "OffloadOptimizer",
    "Optimizer8bit",
    "OptimizerInBackward",
    "PeakMemoryMonitor",
    "SavedTensorProfiler",
    "StageBoundaryRelease",
    "TiledMLP",
]

register_pipeline_strategy()  # strategy="memkit_pipeline" works once Lightning is imported with this
