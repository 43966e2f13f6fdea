"""Run one rank of a pipeline: its ``PipelineStage``(s) and the ``torch.distributed.pipelining`` schedule.

:class:`PipelineRuntime` takes the whole ordered layer list (identical on every rank) and a
:class:`~lightning_memkit.pipeline.Partition`, keeps the layers of this rank's stages, moves them to the
device and, by default, moves every other layer to the ``meta`` device so that its storage is freed.
``train_step`` runs forward and backward over all microbatches and leaves the summed gradients in
``.grad`` (each microbatch loss is divided by ``microbatches * grad_accumulation``, so the gradient
equals that of the batch-mean loss); ``eval_step`` runs forward only. Both return the mean microbatch
loss on every rank (broadcast from the rank that holds the last stage).

Example (one process per rank, process group initialized, same ``layers`` everywhere)::

    from lightning_memkit.pipeline import PipelineRuntime, partition_layers

    part = partition_layers(costs, num_stages=dist.get_world_size(), schedule="1f1b", microbatches=8)
    runtime = PipelineRuntime(layers, part, loss_fn=torch.nn.functional.cross_entropy)
    opt = torch.optim.AdamW(runtime.parameters())
    loss = runtime.train_step(x, y); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_memkit.pipeline.cost import LayerCost, measure_layer_costs, static_cost
from lightning_memkit.pipeline.partition import Partition
from lightning_memkit.validation import check_int

__all__ = [
    "PipelineRuntime",
    "SCHEDULE_CLASSES",
    "check_microbatches",
    "split_batch_size",
    "cross_stage_shared",
    "fused_head_loss",
    "measure_pipeline_costs",
]

# schedule name -> class name in torch.distributed.pipelining
SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def schedule_class(schedule: str) -> type:
    """The ``torch.distributed.pipelining`` class for ``schedule`` (``ValueError`` if this torch lacks it)."""
    if schedule not in SCHEDULE_CLASSES:
        raise ValueError(f"schedule={schedule!r} is not supported; allowed: {', '.join(map(repr, SCHEDULE_CLASSES))}")
    module = importlib.import_module("torch.distributed.pipelining")
    cls = getattr(module, SCHEDULE_CLASSES[schedule], None)
    if cls is None:
        raise ValueError(
            f"schedule={schedule!r} needs torch.distributed.pipelining.{SCHEDULE_CLASSES[schedule]}, which torch "
            f"{torch.__version__} does not have"
        )
    return cls


def check_microbatches(schedule: str, num_stages: int, microbatches: int, num_ranks: int) -> None:
    """Raise ``ValueError`` where ``schedule`` cannot run ``microbatches`` over ``num_stages`` stages."""
    check_int(microbatches, "microbatches", minimum=1)
    if schedule in ("1f1b", "dualpipev") and microbatches < num_stages:
        raise ValueError(
            f"microbatches={microbatches} is too few for schedule={schedule!r} with {num_stages} stages: it needs "
            f"at least {num_stages}"
        )
    if schedule == "interleaved_1f1b":
        rounds = max(1, microbatches // num_ranks)
        if microbatches % rounds:
            raise ValueError(
                f"microbatches={microbatches} must be a multiple of max(1, microbatches // {num_ranks} ranks) = "
                f"{rounds} for schedule='interleaved_1f1b'"
            )


def split_batch_size(batch_size: int, microbatches: int) -> int:
    """Samples per microbatch; ``ValueError`` when ``batch_size`` does not split evenly."""
    if batch_size % microbatches:
        raise ValueError(
            f"a batch of {batch_size} samples does not split into microbatches={microbatches} equal microbatches; "
            f"use a batch size that is a multiple of {microbatches} (drop_last=True in the DataLoader avoids a "
            "short last batch)"
        )
    return batch_size // microbatches


def cross_stage_shared(layers: Sequence[nn.Module], partition: Partition) -> list[str]:
    """Descriptions of parameters used by layers on different ranks (tied weights across ranks)."""
    owner: dict[int, tuple[int, int]] = {}
    problems = []
    for stage in range(partition.num_stages):
        rank = partition.stage_ranks[stage]
        for i in partition.layers_of_stage(stage):
            for name, p in layers[i].named_parameters():
                seen = owner.setdefault(id(p), (i, rank))
                if seen[1] != rank:
                    problems.append(f"layer {i} ({name}) shares a parameter with layer {seen[0]} on another rank")
    return problems


def fused_head_loss(head: nn.Linear) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss(hidden, target)``: cross-entropy of ``head(hidden)`` by ``lightning_memkit.ops.linear_cross_entropy``."""
    try:
        from lightning_memkit.ops import linear_cross_entropy
    except ImportError as err:  # pragma: no cover - depends on the installed package
        raise ValueError(
            "fused_loss=True needs lightning_memkit.ops.linear_cross_entropy, which cannot be imported here"
        ) from err

    def loss(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(hidden, head.weight, target, bias=head.bias)

    return loss


def measure_pipeline_costs(
    layers: Sequence[nn.Module],
    inputs: Any,
    target: Any,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    optimizer: Any = "adamw",
    fused_head: bool = False,
    device: torch.device | str | None = None,
) -> list[LayerCost]:
    """:func:`~lightning_memkit.pipeline.measure_layer_costs` for one microbatch, aware of a fused head.

    With ``fused_head`` the head (the last layer, an ``nn.Linear``) never produces logits: the loss's saved
    bytes and backward workspace are charged to it, together with its static bytes.
    """
    layers = list(layers)
    if not fused_head:
        return measure_layer_costs(layers, inputs, loss_fn=loss_fn, target=target, optimizer=optimizer, device=device)
    head = layers[-1]
    if not isinstance(head, nn.Linear):
        raise TypeError(f"fused_loss=True needs the last layer to be an nn.Linear head, got {type(head).__name__}")
    costs = measure_layer_costs(
        [*layers[:-1], nn.Identity()], inputs, loss_fn=_on(fused_head_loss(head), head, device), target=target,
        optimizer=optimizer, device=device,
    )
    static = static_cost(head, optimizer)
    costs[-1] = LayerCost(
        param_bytes=static.param_bytes,
        grad_bytes=static.grad_bytes,
        optimizer_bytes=static.optimizer_bytes,
        activation_bytes=costs[-1].activation_bytes,
        workspace_bytes=costs[-1].workspace_bytes,
        saves_input=True,  # the hidden states stay alive for the fused loss's backward
    )
    return costs


def _on(loss: Callable, head: nn.Module, device: Any) -> Callable:
    """``loss`` with ``head`` moved to ``device`` while it runs (the head is measured outside the layer loop)."""
    if device is None:
        return loss

    def run(hidden: Any, target: Any) -> torch.Tensor:
        head.to(device)
        return loss(hidden, target)

    return run


class _FusedTail(nn.Module):
    """The last stage with a fused LM-head loss: runs every layer but the head; the loss uses ``head.weight``."""

    def __init__(self, body: nn.Sequential, head: nn.Linear):
        super().__init__()
        self.body, self.head = body, head

    def forward(self, x: Any) -> Any:
        return self.body(x)


class PipelineRuntime:
    """This rank's share of a pipeline: stage modules, ``PipelineStage`` objects and the schedule.

    Args:
        layers: the ordered layers (every rank passes the same list); each takes and returns one tensor.
        partition: where the layers go (:func:`~lightning_memkit.pipeline.partition_layers`).
        loss_fn: ``loss_fn(last_output, target) -> scalar`` for one microbatch (a mean over its samples).
        device: device of this rank's stages (default: cpu).
        group: process group of the pipeline (default: the world).
        release_remote: move layers that other ranks hold to ``meta`` (frees their storage).
        fused_head: the last layer is an ``nn.Linear`` LM head; the last stage skips it and computes
            ``linear_cross_entropy(hidden, head.weight, target)`` instead of ``loss_fn`` (no logits).
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        partition: Partition,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
        release_remote: bool = True,
        fused_head: bool = False,
    ):
        if not isinstance(partition, Partition):
            raise TypeError(f"partition must be a Partition, got {type(partition).__name__}")
        layers = list(layers)
        if len(layers) != partition.boundaries[-1]:
            raise ValueError(f"partition covers {partition.boundaries[-1]} layers, but {len(layers)} were given")
        for i, layer in enumerate(layers):
            if not isinstance(layer, nn.Module):
                raise TypeError(f"layers[{i}] must be a torch.nn.Module, got {type(layer).__name__}")
        if loss_fn is None and not fused_head:
            raise ValueError("loss_fn is required (or fused_head=True)")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "PipelineRuntime needs an initialized process group (torch.distributed.init_process_group)"
            )
        self.group = group if group is not None else dist.group.WORLD
        world = dist.get_world_size(self.group)
        if world != partition.num_ranks:
            raise ValueError(f"partition is for {partition.num_ranks} ranks, but the process group has {world}")
        self.schedule_name = partition.schedule
        cls = schedule_class(self.schedule_name)
        check_microbatches(self.schedule_name, partition.num_stages, partition.microbatches, world)
        shared = cross_stage_shared(layers, partition)
        if shared:
            raise ValueError("tied parameters cannot span pipeline ranks: " + "; ".join(shared[:3]))
        head = layers[-1]
        if fused_head and not isinstance(head, nn.Linear):
            raise TypeError(f"fused_head=True needs the last layer to be an nn.Linear head, got {type(head).__name__}")
        self.partition = partition
        self.rank = dist.get_rank(self.group)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.loss_fn = loss_fn
        self.fused_head = fused_head
        self.microbatches = partition.microbatches
        self.stage_indices = partition.stages_of_rank(self.rank)
        self.layer_indices = tuple(i for s in self.stage_indices for i in partition.layers_of_stage(s))
        last_stage = partition.num_stages - 1
        self.holds_first = 0 in self.stage_indices
        self.holds_last = last_stage in self.stage_indices
        self._last_rank = dist.get_global_rank(self.group, partition.stage_ranks[last_stage])

        # build every local module before touching anything (nothing half-applied on error)
        modules: list[nn.Module] = []
        for s in self.stage_indices:
            body = [layers[i] for i in partition.layers_of_stage(s)]
            if fused_head and s == last_stage:
                modules.append(_FusedTail(nn.Sequential(*body[:-1]), body[-1]))
            else:
                modules.append(nn.Sequential(*body))
        self._fused = fused_head_loss(head) if fused_head and self.holds_last else None
        from torch.distributed.pipelining import PipelineStage

        local = set(self.layer_indices)
        if release_remote:
            for i, layer in enumerate(layers):
                if i not in local:
                    layer.to("meta")
        for m in modules:
            m.to(self.device)
        self.modules = modules
        self.stages = [
            PipelineStage(m, stage_index=s, num_stages=partition.num_stages, device=self.device, group=self.group)
            for m, s in zip(modules, self.stage_indices)
        ]
        self._grad_scale = 1.0
        self._raw: list[torch.Tensor] = []
        single = partition.stages_per_rank == 1
        self.schedule = cls(
            self.stages[0] if single else self.stages,
            partition.microbatches,
            loss_fn=self._loss,
            scale_grads=False,
        )

    # -- running -------------------------------------------------------------------------------------------
    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        loss = self._fused(output, target) if self._fused is not None else self.loss_fn(output, target)
        self._raw.append(loss.detach())
        return loss * self._grad_scale

    @staticmethod
    def _first_tensor(inputs: Any) -> torch.Tensor:
        items = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        tensors = [t for t in items if isinstance(t, torch.Tensor)]
        if not tensors:
            raise TypeError(f"inputs must be a tensor or a tuple of tensors, got {type(inputs).__name__}")
        return tensors[0]

    def _check_batch(self, inputs: Any) -> None:
        split_batch_size(self._first_tensor(inputs).shape[0], self.microbatches)

    def _mean_loss(self, weights: Sequence[int] | None = None) -> torch.Tensor:
        if self.holds_last:
            raw = torch.stack(self._raw[-(len(weights) if weights else self.microbatches):]).float()
            if weights:  # microbatches of unequal size: the mean over samples
                w = torch.tensor(weights, dtype=raw.dtype, device=raw.device)
                value = ((raw * w).sum() / w.sum()).to(self.device)
            else:  # earlier entries (if any) come from torch's shape inference
                value = raw.mean().to(self.device)
        else:
            value = torch.zeros((), dtype=torch.float32, device=self.device)
        self._raw.clear()
        dist.broadcast(value, src=self._last_rank, group=self.group)
        return value

    def _args(self, inputs: Any) -> tuple:
        if not self.holds_first:
            return ()
        return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)

    def train_step(self, inputs: Any, target: Any, *, grad_accumulation: int = 1) -> torch.Tensor:
        """Forward and backward over every microbatch; gradients accumulate into ``.grad``; returns the mean loss."""
        check_int(grad_accumulation, "grad_accumulation", minimum=1, owner="PipelineRuntime.train_step")
        self._check_batch(inputs)
        self._grad_scale = 1.0 / (self.microbatches * grad_accumulation)
        self._raw.clear()
        with torch.enable_grad():
            self.schedule.step(
                *self._args(inputs), target=target if self.holds_last else None, return_outputs=False
            )
        return self._mean_loss()

    @torch.no_grad()
    def eval_step(self, inputs: Any, target: Any) -> torch.Tensor:
        """Forward only; returns the loss averaged over samples (no gradients, no graph).

        Every rank passes the whole batch. It is cut into at most ``microbatches`` pieces, which need not
        be equal (a short last validation batch is fine). The stages run microbatch by microbatch in stage
        order with blocking point-to-point transfers (every rank walks the same order, so it cannot
        deadlock); the training schedule is left untouched.
        """
        first = self._first_tensor(inputs)
        sizes = [c.shape[0] for c in torch.tensor_split(first, self.microbatches) if c.shape[0] > 0]
        m = len(sizes)
        self._raw.clear()
        args = self._args(inputs)
        chunks = [torch.tensor_split(t, m) for t in args]
        targets = torch.tensor_split(target, m) if self.holds_last else [None] * m
        owner = self.partition.stage_ranks
        local = dict(zip(self.stage_indices, self.modules))
        last = self.partition.num_stages - 1
        for mb in range(m):
            x: Any = None
            for s in range(self.partition.num_stages):
                if owner[s] != self.rank:
                    if s > 0 and owner[s - 1] == self.rank:
                        self._send(x, owner[s])
                    continue
                if s == 0:
                    x = tuple(c[mb] for c in chunks)
                elif owner[s - 1] != self.rank:
                    x = (self._recv(owner[s - 1]),)
                else:
                    x = (x,)
                x = local[s](*x)
                if s == last:
                    self._raw.append(self._fused(x, targets[mb]) if self._fused else self.loss_fn(x, targets[mb]))
        return self._mean_loss(sizes)

    _DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)

    def _send(self, x: torch.Tensor, to: int) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() > 8 or x.dtype not in self._DTYPES:
            raise TypeError(
                "pipeline layers must pass one tensor (at most 8 dims, a float or int dtype) between stages"
            )
        header = torch.zeros(10, dtype=torch.int64)
        header[0], header[1] = x.dim(), self._DTYPES.index(x.dtype)
        header[2:2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
        peer = dist.get_global_rank(self.group, to)
        dist.send(header.to(self.device), dst=peer, group=self.group)
        dist.send(x.contiguous(), dst=peer, group=self.group)

    def _recv(self, src: int) -> torch.Tensor:
        peer = dist.get_global_rank(self.group, src)
        header = torch.zeros(10, dtype=torch.int64, device=self.device)
        dist.recv(header, src=peer, group=self.group)
        ndim, dtype = int(header[0]), self._DTYPES[int(header[1])]
        out = torch.empty(header[2:2 + ndim].tolist(), dtype=dtype, device=self.device)
        dist.recv(out, src=peer, group=self.group)
        return out

    # -- access --------------------------------------------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (each once)."""
        seen = set()
        for m in self.modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def train(self, mode: bool = True) -> PipelineRuntime:
        for m in self.modules:
            m.train(mode)
        return self
