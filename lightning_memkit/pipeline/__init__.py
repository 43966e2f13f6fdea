"""Pipeline parallelism, pure torch: the per-layer cost model, the memory-balanced partition, the runtime over
``torch.distributed.pipelining``, gradient sync and sharding, and crash-consistent sharded checkpoints."""

from lightning_memkit.pipeline.cost import (
    SCHEDULES,
    LayerCost,
    as_layer_costs,
    inflight_microbatches,
    measure_layer_costs,
    optimizer_state_bytes,
    resolve_stages_per_rank,
    shared_parameter_costs,
    stage_to_rank,
    static_cost,
)
from lightning_memkit.pipeline.partition import (
    Partition,
    evaluate_partition,
    parameter_balanced_partition,
    partition_layers,
    stage_cost_matrix,
    uniform_partition,
)
from lightning_memkit.pipeline.runtime import BatchLoss, LayerChain, PipelineRuntime, stage_scratch

__all__ = [
    "SCHEDULES",
    "BatchLoss",
    "LayerChain",
    "LayerCost",
    "Partition",
    "PipelineRuntime",
    "as_layer_costs",
    "evaluate_partition",
    "inflight_microbatches",
    "measure_layer_costs",
    "optimizer_state_bytes",
    "parameter_balanced_partition",
    "partition_layers",
    "resolve_stages_per_rank",
    "shared_parameter_costs",
    "stage_cost_matrix",
    "stage_scratch",
    "stage_to_rank",
    "static_cost",
    "uniform_partition",
]
