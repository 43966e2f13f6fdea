"""The options of a pipeline run, validated in one place: :class:`PipelineConfig`.

:class:`~lightning_memkit.strategies.MemkitPipelineStrategy` takes these options as keyword arguments (so that
LightningCLI YAML lists them under ``init_args``) and keeps them as one frozen ``PipelineConfig``; every bad
value fails when the config is built, with a message naming the argument and what is allowed, before any
process group or model is touched.

Example::

    >>> from lightning_memkit.pipeline.config import PipelineConfig
    >>> cfg = PipelineConfig(schedule="dualpipev", microbatches=8, pipeline_parallel_size=2)
    >>> cfg.stages_per_rank, cfg.mesh_shape(world_size=8), cfg.timeout.total_seconds()
    (2, (4, 2), 1800.0)
    >>> PipelineConfig(schedule="2f2b")
    Traceback (most recent call last):
    ...
    ValueError: PipelineConfig(schedule='2f2b'): must be one of 'gpipe', '1f1b', 'interleaved_1f1b', 'zbv', ...
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lightning_memkit.common.validation import ArgumentTypeError, check_bool, check_choice, check_int, check_number
from lightning_memkit.pipeline.cost import SCHEDULES, resolve_stages_per_rank

__all__ = ["PipelineConfig", "PARTITION_METHODS", "DATA_PARALLEL", "DEFAULT_TIMEOUT", "schedule_class"]

PARTITION_METHODS = ("memory", "uniform", "parameters")
DATA_PARALLEL = ("ddp", "fsdp")
DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch.distributed's default process-group timeout
_OWNER = "PipelineConfig"
# our schedule names -> torch.distributed.pipelining's names (get_schedule_class takes them case-insensitively)
_TORCH_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B", "zbv": "ZBVZeroBubble",
                "dualpipev": "DualPipeV"}


def schedule_class(schedule: str) -> type:
    """The ``torch.distributed.pipelining`` schedule class for one of :data:`SCHEDULES` (``get_schedule_class``).

    Example::

        >>> from lightning_memkit.pipeline.config import schedule_class
        >>> schedule_class("1f1b").__name__
        'Schedule1F1B'
    """
    from torch.distributed.pipelining.schedules import get_schedule_class

    name = check_choice(schedule, "schedule", SCHEDULES, owner=_OWNER)
    try:
        return get_schedule_class(_TORCH_NAMES[name])
    except ValueError as err:
        import torch

        raise ValueError(f"schedule={schedule!r} needs a torch with {_TORCH_NAMES[name]}; torch "
                         f"{torch.__version__} has not: {err}") from None


def _partition(value: Any) -> str | tuple[int, ...]:
    if isinstance(value, str):
        return check_choice(value, "partition", PARTITION_METHODS, owner=_OWNER)
    if isinstance(value, Sequence) and value and all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in value
    ):
        return tuple(value)
    raise ValueError(
        f"{_OWNER}(partition={value!r}): must be one of {', '.join(map(repr, PARTITION_METHODS))} or a non-empty "
        "list of ints >= 1 (layers per stage)"
    )


def _timeout(value: Any) -> timedelta:
    """``None`` (torch's default, 30 min), a finite number of seconds > 0 or a positive ``timedelta``."""
    if value is None:
        return DEFAULT_TIMEOUT
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ArgumentTypeError(
            f"{_OWNER}(timeout={value!r}): must be seconds (a finite number > 0), a timedelta or None, "
            f"got {type(value).__name__}"
        )
    return timedelta(seconds=check_number(seconds, "timeout", minimum=0, min_inclusive=False, owner=_OWNER))


@dataclass(frozen=True)
class PipelineConfig:
    """What a pipeline run does; each field is validated when the config is built.

    Args:
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zbv"`` or ``"dualpipev"``.
        microbatches: microbatches per batch (the per-replica batch size must be a multiple).
        partition: ``"memory"``, ``"uniform"``, ``"parameters"`` or a list of layers per stage.
        stages_per_rank: for ``interleaved_1f1b`` (default 2); the other schedules fix it (1 or 2).
        max_bytes_per_rank: with ``partition="memory"``, fail at setup if the best split needs more.
        fused_loss: the last layer is an ``nn.Linear`` LM head whose loss runs without logits.
        router_aux: Hugging Face MoE router loss: ``"exact"`` or ``"microbatch"``.
        timeout: process-group timeout in seconds (or a ``timedelta``); ``None``: 30 minutes.
        pipeline_parallel_size: ranks per pipeline replica (``P``); ``None``: the whole world (no data
            parallelism). The world must be a multiple of it; ``world / P`` replicas train on their own data.
        data_parallel: how the replicas share the work: ``"ddp"`` (each stage replicated, its gradients averaged
            over the replicas) or ``"fsdp"`` (each stage's layers sharded over the replicas with FSDP2
            ``fully_shard``; not with ``fused_loss=True``).
    """

    schedule: str = "1f1b"
    microbatches: int = 4
    partition: str | tuple[int, ...] = "memory"
    stages_per_rank: int | None = None
    max_bytes_per_rank: int | None = None
    fused_loss: bool = False
    router_aux: str = "exact"
    timeout: Any = None
    pipeline_parallel_size: int | None = None
    data_parallel: str = "ddp"

    def __post_init__(self) -> None:
        put = object.__setattr__  # frozen: the validated values replace the given ones once
        schedule = check_choice(self.schedule.lower() if isinstance(self.schedule, str) else self.schedule,
                                "schedule", SCHEDULES, owner=_OWNER)
        put(self, "schedule", schedule)
        put(self, "microbatches", check_int(self.microbatches, "microbatches", minimum=1, owner=_OWNER))
        partition = _partition(self.partition)
        put(self, "partition", partition)
        v = resolve_stages_per_rank(schedule, self.stages_per_rank)
        if v > 2 and partition == "memory":
            raise ValueError(
                f"{_OWNER}(stages_per_rank={v}) with partition='memory' is not supported (the exact search handles "
                "2); pass partition='uniform', 'parameters' or explicit sizes"
            )
        put(self, "stages_per_rank", v)
        put(self, "max_bytes_per_rank", check_int(self.max_bytes_per_rank, "max_bytes_per_rank", minimum=1,
                                                  allow_none=True, owner=_OWNER))
        if self.max_bytes_per_rank is not None and partition != "memory":
            raise ValueError(f"{_OWNER}(max_bytes_per_rank=...) needs partition='memory' (the only method that "
                             "predicts peaks)")
        put(self, "fused_loss", check_bool(self.fused_loss, "fused_loss", owner=_OWNER))
        check_choice(self.router_aux, "router_aux", ("exact", "microbatch"), owner=_OWNER)
        put(self, "timeout", _timeout(self.timeout))
        put(self, "pipeline_parallel_size", check_int(self.pipeline_parallel_size, "pipeline_parallel_size",
                                                      minimum=1, allow_none=True, owner=_OWNER))
        check_choice(self.data_parallel, "data_parallel", DATA_PARALLEL, owner=_OWNER)
        if self.data_parallel == "fsdp" and self.fused_loss:
            raise NotImplementedError(
                f"{_OWNER}(data_parallel='fsdp', fused_loss=True): the fused loss reads the head's weight outside "
                "the head's forward, where FSDP keeps it sharded; use data_parallel='ddp' or fused_loss=False"
            )

    def mesh_shape(self, world_size: int) -> tuple[int, int]:
        """``(dp, pp)``: data-parallel replicas and ranks per pipeline for ``world_size`` ranks."""
        pp = self.pipeline_parallel_size or world_size
        if world_size % pp:
            allowed = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
            raise ValueError(
                f"{_OWNER}(pipeline_parallel_size={pp}): the {world_size} ranks (devices x num_nodes) must be a "
                f"multiple of it; allowed here: {allowed}"
            )
        return world_size // pp, pp
