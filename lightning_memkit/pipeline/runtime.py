"""Run one rank of a pipeline: its ``PipelineStage``(s) and the ``torch.distributed.pipelining`` schedule.

:class:`PipelineRuntime` takes the whole ordered layer list (identical on every rank) and a
:class:`~lightning_memkit.pipeline.Partition`, keeps the layers of this rank's stages, moves them to the
device and, by default, moves every other layer to the ``meta`` device so that its storage is freed.
``train_step`` runs forward and backward over all microbatches and leaves the summed gradients in
``.grad`` (each microbatch loss is divided by ``microbatches * grad_accumulation``, so the gradient
equals that of the batch-mean loss); ``eval_step`` runs forward only. Both return the mean microbatch
loss on every rank (broadcast from the rank that holds the last stage).

Layers pass activations on: a tensor, or a tuple of tensors that the next layer takes as positional arguments
(hidden states together with masks, positions or running statistics). The layers of one stage run in a
:class:`LayerChain`, which gives them a scratch dict (:func:`stage_scratch`) for work they can share within one
stage call (an attention mask built once for all of them). A :class:`BatchLoss` sees the whole batch's target
before its microbatches run and computes the reported value itself (a mean over the valid tokens of the batch,
say, rather than over microbatches).

Example (one process per rank, process group initialized, same ``layers`` everywhere)::

    from lightning_memkit.pipeline import PipelineRuntime, partition_layers

    part = partition_layers(costs, num_stages=dist.get_world_size(), schedule="1f1b", microbatches=8)
    runtime = PipelineRuntime(layers, part, loss_fn=torch.nn.functional.cross_entropy)
    opt = torch.optim.AdamW(runtime.parameters())
    loss = runtime.train_step(x, y); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_memkit.common.validation import check_int
from lightning_memkit.pipeline.config import schedule_class
from lightning_memkit.pipeline.cost import LayerCost, measure_layer_costs, static_cost
from lightning_memkit.pipeline.partition import Partition

__all__ = [
    "BatchLoss",
    "LayerChain",
    "PipelineRuntime",
    "check_microbatches",
    "split_batch_size",
    "Tie",
    "release_to_meta",
    "tied_parameters",
    "fused_head_loss",
    "measure_pipeline_costs",
    "stage_scratch",
]

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


@dataclass(frozen=True)
class Tie:
    """One parameter used by layers on several pipeline ranks (a tied input/output embedding, say).

    ``ranks``: the pipeline ranks that use it, sorted (the first one counts it for the global norm);
    ``names``: ``"layer <i> (<name>)"`` of each use; ``param``: the parameter object in the full layer list.
    """

    ranks: tuple[int, ...]
    names: tuple[str, ...]
    param: nn.Parameter
    uses: tuple[tuple[int, str], ...] = ()  # (layer index, parameter name in that layer) of each use

    def local_param(self, layers: Sequence[nn.Module], local: Sequence[int]) -> nn.Parameter:
        """The parameter as the first of the ``local`` layers that use it holds it now (after ``fully_shard``)."""
        for i, name in self.uses:
            if i in local:
                return layers[i].get_parameter(name)
        raise ValueError(f"no local layer uses the tied parameter ({', '.join(self.names)})")


def tied_parameters(layers: Sequence[nn.Module], partition: Partition) -> list[Tie]:
    """The parameters that layers on different ranks share, in order of first use (the same on every rank).

    Example::

        >>> from torch import nn
        >>> from lightning_memkit.pipeline import evaluate_partition
        >>> from lightning_memkit.pipeline.runtime import tied_parameters
        >>> emb, head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
        >>> head.weight = emb.weight
        >>> part = evaluate_partition([1, 1, 1], [1, 2], schedule="gpipe")
        >>> [(t.ranks, t.names) for t in tied_parameters([emb, nn.Linear(4, 4), head], part)]
        [((0, 1), ('layer 0 (weight)', 'layer 2 (weight)'))]
    """
    uses: dict[int, tuple[nn.Parameter, set[int], list[tuple[int, str]]]] = {}
    for stage in range(partition.num_stages):
        rank = partition.stage_ranks[stage]
        for i in partition.layers_of_stage(stage):
            for name, p in layers[i].named_parameters():
                entry = uses.setdefault(id(p), (p, set(), []))
                entry[1].add(rank)
                entry[2].append((i, name))
    return [Tie(tuple(sorted(ranks)), tuple(f"layer {i} ({n})" for i, n in where), p, tuple(where))
            for p, ranks, where in uses.values() if len(ranks) > 1]


def release_to_meta(layer: nn.Module, keep: set[int]) -> None:
    """Move ``layer``'s parameters and buffers to ``meta`` (freeing their storage), except those in ``keep``.

    A kept parameter (``id`` in ``keep``: another local layer uses it) is replaced in ``layer`` by a ``meta``
    stand-in, so the local layer keeps the real one; so is a parameter of a subclass that cannot move to ``meta``
    (bitsandbytes' packed ``Params4bit``): the layer is never run here.
    """
    for module in layer.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) in keep or type(p) is not nn.Parameter:
                module.register_parameter(name, nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad))
    layer.to("meta")


class BatchLoss:
    """A pipeline loss that sees the whole batch: :meth:`begin` before its microbatches, :meth:`end` for its value.

    The schedule calls the loss once per microbatch, ``loss(output, target_chunk)``, and back-propagates the mean
    of these terms over the microbatches, so a subclass returns terms whose mean is the batch loss: for a mean
    over the valid tokens of the whole batch, ``microbatches * token_loss_sum / valid_tokens_in_batch``.
    :meth:`end` gets the terms of the batch's microbatches, in order, and returns the value to report. torch's
    shape inference runs the first microbatch once more on the first step: those extra calls come before the
    batch's own, so the batch's terms are always the last ones.

    With ``observes_forward = True``, :meth:`PipelineRuntime.train_step` first runs the batch forward without
    gradients through every stage and hands each microbatch's last-stage output to :meth:`observe` (after
    :meth:`begin`): for a loss whose every microbatch gradient depends on statistics of the whole batch. It costs
    one more forward pass per training step.

    Example::

        >>> import torch
        >>> class TokenMean(BatchLoss):  # mean over all tokens of the batch, whatever the microbatch sizes
        ...     def begin(self, target, microbatches):
        ...         self.scale = microbatches / target.numel()
        ...     def __call__(self, output, target):
        ...         return (output - target).pow(2).sum() * self.scale
        >>> loss, y = TokenMean(), torch.arange(6.0)
        >>> loss.begin(y, 2)
        >>> float(loss.end([loss(torch.zeros(2), y[:2]), loss(torch.zeros(4), y[2:])])), float(y.pow(2).mean())
        (9.166666984558105, 9.166666984558105)
    """

    observes_forward: bool = False

    def begin(self, target: Any, microbatches: int) -> None:
        """Called with the whole batch's ``target`` before its ``microbatches`` run (on the last stage's rank)."""

    def observe(self, output: Any, target: Any) -> None:
        """With ``observes_forward``: one microbatch's last-stage output of the forward pass without gradients."""

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(output, target)")

    def end(self, terms: Sequence[torch.Tensor]) -> torch.Tensor:
        """The loss to report for the batch from the terms of its microbatches; default: their mean."""
        return torch.stack([t.detach().float() for t in terms]).mean()

    def whole(self, output: Any, target: Any) -> torch.Tensor:
        """The (differentiable) loss of a batch run as one microbatch, outside a pipeline."""
        self.begin(target, 1)
        return self(output, target)


_SCRATCH: contextvars.ContextVar[dict | None] = contextvars.ContextVar("memkit_stage_scratch", default=None)


def stage_scratch() -> dict | None:
    """A dict shared by the layers of the :class:`LayerChain` call in progress; ``None`` outside one.

    It lives for one call of one stage on one microbatch: a layer may leave there what the next layers of the
    same call can reuse (keyed by the input it was derived from, e.g. an attention mask built from a padding
    mask); nothing in it outlives the call.
    """
    return _SCRATCH.get()


#: torch from which ``PipelineStage`` passes tuples of tensors, integer ones and ones without gradient
#: included (older ones mark every received tensor as requiring grad, which integer tensors cannot).
TUPLES_SINCE = "2.13"


class LayerChain(nn.Sequential):
    """Layers run in order; a tuple output goes to the next layer as positional arguments.

    A stage's module: ``PipelineStage`` calls it with the received tensors as positional arguments, and it
    opens a fresh :func:`stage_scratch` for the call. :class:`PipelineRuntime` sets ``sends = True`` on the
    chains whose output goes to another stage: with a torch older than :data:`TUPLES_SINCE` such a chain
    refuses to return a tuple (``TypeError``) rather than let ``PipelineStage`` fail on the receiving rank.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> class Split(nn.Module):
        ...     def forward(self, x):
        ...         return x, 2 * x
        >>> class Add(nn.Module):
        ...     def forward(self, a, b):
        ...         return a + b
        >>> LayerChain(Split(), Add())(torch.ones(2)).tolist()
        [3.0, 3.0]
    """

    sends = False

    def forward(self, *args: Any) -> Any:
        token = _SCRATCH.set({})
        try:
            x: Any = args[0] if len(args) == 1 else args
            for layer in self:
                x = layer(*x) if isinstance(x, tuple) else layer(x)
        finally:
            _SCRATCH.reset(token)
        if self.sends and isinstance(x, tuple) and torch.torch_version.TorchVersion(torch.__version__) < TUPLES_SINCE:
            raise TypeError(
                f"this stage passes a tuple of {len(x)} tensors to the next one, which needs torch >= {TUPLES_SINCE}: "
                f"torch {torch.__version__}'s PipelineStage marks every tensor it receives as requiring grad (it fails "
                "on integer ones); pass one tensor between stages or upgrade torch"
            )
        return x


def fused_head_loss(head: nn.Linear) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss(hidden, target)``: cross-entropy of ``head(hidden)`` by ``lightning_memkit.ops.linear_cross_entropy``,
    in the head's numerics (``logits_dtype="head"``), as the loss on the head's output that it replaces."""
    try:
        from lightning_memkit.ops import linear_cross_entropy
    except ImportError as err:  # pragma: no cover - depends on the installed package
        raise ValueError(
            "fused_loss=True needs lightning_memkit.ops.linear_cross_entropy, which cannot be imported here"
        ) from err

    def loss(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(
                "fused_loss=True needs the layer before the head to return one tensor (the hidden states), got "
                f"{type(hidden).__name__}"
            )
        return linear_cross_entropy(hidden, head.weight, target, bias=head.bias, logits_dtype="head")

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
    if isinstance(loss_fn, BatchLoss):
        loss_fn.begin(target, 1)
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
        largest_grad_bytes=static.largest_grad_bytes,
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

    def __init__(self, body: LayerChain, head: nn.Linear):
        super().__init__()
        self.body, self.head = body, head

    def forward(self, *args: Any) -> Any:
        return self.body(*args)


def _check_arguments(layers: list[Any], partition: Any, loss_fn: Any, fused_head: bool, group: Any) -> None:
    """Every argument of :class:`PipelineRuntime` checked before it touches anything."""
    if not isinstance(partition, Partition):
        raise TypeError(f"partition must be a Partition, got {type(partition).__name__}")
    if len(layers) != partition.boundaries[-1]:
        raise ValueError(f"partition covers {partition.boundaries[-1]} layers, but {len(layers)} were given")
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layers[{i}] must be a torch.nn.Module, got {type(layer).__name__}")
    if loss_fn is None and not fused_head:
        raise ValueError("loss_fn is required (or fused_head=True)")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if fused_head and not isinstance(layers[-1], nn.Linear):
        got = type(layers[-1]).__name__
        raise TypeError(f"fused_head=True needs the last layer to be an nn.Linear head, got {got}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("PipelineRuntime needs an initialized process group (torch.distributed.init_process_group)")
    world = dist.get_world_size(group)
    if world != partition.num_ranks:
        raise ValueError(f"partition is for {partition.num_ranks} ranks, but the process group has {world}")
    check_microbatches(partition.schedule, partition.num_stages, partition.microbatches, world)


class PipelineRuntime:
    """This rank's share of a pipeline: stage modules, ``PipelineStage`` objects and the schedule.

    Args:
        layers: the ordered layers (every rank passes the same list); each takes the previous layer's output (a
            tuple as positional arguments) and returns a tensor or a tuple of tensors.
        partition: where the layers go (:func:`~lightning_memkit.pipeline.partition_layers`).
        loss_fn: ``loss_fn(last_output, target) -> scalar`` for one microbatch (a mean over its samples), or a
            :class:`BatchLoss`.
        device: device of this rank's stages (default: cpu).
        group: process group of the pipeline (default: the world).
        release_remote: move layers that other ranks hold to ``meta`` (frees their storage).
        fused_head: the last layer is an ``nn.Linear`` LM head; the last stage skips it and computes
            ``linear_cross_entropy(hidden, head.weight, target)`` instead of ``loss_fn`` (no logits).
        prepare: called with the runtime once its stage modules (``self.modules``) are on the device and before
            torch's ``PipelineStage`` objects wrap them (``fully_shard`` them there, or synchronize weights).
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
        prepare: Callable[[PipelineRuntime], None] | None = None,
    ):
        layers = list(layers)
        self.group = group if group is not None else dist.group.WORLD
        _check_arguments(layers, partition, loss_fn, fused_head, self.group)
        cls = schedule_class(partition.schedule)
        self.schedule_name = partition.schedule
        self.ties = tied_parameters(layers, partition)
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
        self._fused = fused_head_loss(layers[-1]) if fused_head and self.holds_last else None
        self._batch_loss = loss_fn if isinstance(loss_fn, BatchLoss) and not fused_head else None
        self.modules = self._stage_modules(layers)  # built before anything is moved: nothing half-applied on error
        if release_remote:
            self._release_remote(layers)
        for m in self.modules:
            m.to(self.device)
        if prepare is not None:  # e.g. shard the stage modules over data-parallel replicas before torch's stages
            prepare(self)
        self._grad_scale = 1.0
        self._raw: list[torch.Tensor] = []
        self._train_shapes: list[tuple] | None = None
        self.stages, self.schedule = self._schedule(cls)

    def _release_remote(self, layers: list[nn.Module]) -> None:
        """Other ranks' layers go to ``meta`` (their storage is freed); a parameter a local layer shares stays."""
        local = set(self.layer_indices)
        keep = {id(p) for i in local for p in layers[i].parameters()}
        for i, layer in enumerate(layers):
            if i not in local:
                release_to_meta(layer, keep)

    def _stage_modules(self, layers: list[nn.Module]) -> list[nn.Module]:
        """One module per local stage: a ``LayerChain`` of its layers (the fused tail for the last, if fused)."""
        last_stage = self.partition.num_stages - 1
        modules: list[nn.Module] = []
        for s in self.stage_indices:
            body = [layers[i] for i in self.partition.layers_of_stage(s)]
            if self.fused_head and s == last_stage:
                modules.append(_FusedTail(LayerChain(*body[:-1]), body[-1]))
            else:
                modules.append(LayerChain(*body))
                modules[-1].sends = s != last_stage
        return modules

    def _schedule(self, cls: type) -> tuple[list[Any], Any]:
        """torch's ``PipelineStage`` for each local stage module, and the schedule that runs them."""
        from torch.distributed.pipelining import PipelineStage

        part = self.partition
        stages = [
            PipelineStage(m, stage_index=s, num_stages=part.num_stages, device=self.device, group=self.group)
            for m, s in zip(self.modules, self.stage_indices)
        ]
        schedule = cls(stages[0] if part.stages_per_rank == 1 else stages, part.microbatches, loss_fn=self._loss,
                       scale_grads=False)
        return stages, schedule

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

    def _check_batch(self, inputs: Any, target: Any) -> None:
        """The batch splits into the microbatches and has the shapes the stages fixed at the first training step."""
        split_batch_size(self._first_tensor(inputs).shape[0], self.microbatches)
        items = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in (*items, target)]
        if self._train_shapes is None:
            self._train_shapes = shapes
        elif shapes != self._train_shapes:
            raise ValueError(
                f"this training batch has shapes {shapes} (inputs..., target), but the pipeline stages fixed "
                f"{self._train_shapes} at the first training step (torch's PipelineStage keeps its receive buffers); "
                "give every training batch the same shape (pad to one sequence length, drop_last=True)"
            )

    def _begin(self, target: Any, microbatches: int) -> None:
        self._raw.clear()
        if self.holds_last and self._batch_loss is not None:
            self._batch_loss.begin(target, microbatches)

    def _mean_loss(self, count: int, weights: Sequence[int] | None = None) -> torch.Tensor:
        """The batch loss from the last ``count`` microbatch losses, broadcast from the last stage's rank."""
        if self.holds_last:
            terms = self._raw[-count:]  # earlier entries (if any) come from torch's shape inference
            if self._batch_loss is not None:
                value = self._batch_loss.end(terms).float().reshape(()).to(self.device)
            elif weights:  # microbatches of unequal size: the mean over samples
                raw = torch.stack(terms).float()
                w = torch.tensor(weights, dtype=raw.dtype, device=raw.device)
                value = ((raw * w).sum() / w.sum()).to(self.device)
            else:
                value = torch.stack(terms).float().mean().to(self.device)
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
        self._check_batch(inputs, target)
        self._grad_scale = 1.0 / (self.microbatches * grad_accumulation)
        self._begin(target, self.microbatches)
        if self._batch_loss is not None and self._batch_loss.observes_forward:
            self._observe(inputs, target)
        with torch.enable_grad():
            self.schedule.step(
                *self._args(inputs), target=target if self.holds_last else None, return_outputs=False
            )
        return self._mean_loss(self.microbatches)

    @torch.no_grad()
    def eval_step(self, inputs: Any, target: Any) -> torch.Tensor:
        """Forward only; returns the loss averaged over samples (no gradients, no graph).

        Every rank passes the whole batch. It is cut into at most ``microbatches`` pieces, which need not
        be equal (a short last validation batch is fine). The stages run microbatch by microbatch in stage
        order with blocking point-to-point transfers (every rank walks the same order, so it cannot
        deadlock); the training schedule is left untouched. A :class:`BatchLoss` computes the value itself.
        """
        first = self._first_tensor(inputs)
        sizes = [c.shape[0] for c in torch.tensor_split(first, self.microbatches) if c.shape[0] > 0]
        m = len(sizes)
        self._begin(target, m)
        args = self._args(inputs)
        chunks = [torch.tensor_split(t, m) for t in args]
        targets = torch.tensor_split(target, m) if self.holds_last else [None] * m
        for mb in range(m):
            out = self._eval_microbatch(tuple(c[mb] for c in chunks))
            if out is not None:
                self._raw.append(self._fused(out, targets[mb]) if self._fused else self.loss_fn(out, targets[mb]))
        return self._mean_loss(m, sizes)

    @torch.no_grad()
    def predict_step(self, inputs: Any) -> Any:
        """Forward only, no loss: the last layer's output for the whole batch on the last stage's rank, else ``None``.

        Cut into microbatches and walked like :meth:`eval_step`; the microbatch outputs are concatenated along
        dim 0 (element-wise for a tuple). With ``fused_head`` the head is applied here, so the output is logits.
        """
        first = self._first_tensor(inputs)
        m = sum(1 for c in torch.tensor_split(first, self.microbatches) if c.shape[0] > 0)
        chunks = [torch.tensor_split(t, m) for t in self._args(inputs)]
        tail = dict(zip(self.stage_indices, self.modules)).get(self.partition.num_stages - 1)
        outputs = []
        for mb in range(m):
            out = self._eval_microbatch(tuple(c[mb] for c in chunks))
            if out is not None:
                outputs.append(tail.head(out) if self.fused_head else out)
        if not outputs:
            return None
        if isinstance(outputs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*outputs))
        return torch.cat(outputs)

    @torch.no_grad()
    def _observe(self, inputs: Any, target: Any) -> None:
        """The forward pass without gradients that a :class:`BatchLoss` with ``observes_forward`` sees first."""
        chunks = [torch.tensor_split(t, self.microbatches) for t in self._args(inputs)]
        targets = torch.tensor_split(target, self.microbatches) if self.holds_last else [None] * self.microbatches
        for mb in range(self.microbatches):
            out = self._eval_microbatch(tuple(c[mb] for c in chunks))
            if out is not None:
                self._batch_loss.observe(out, targets[mb])

    def _eval_microbatch(self, first_args: tuple) -> Any:
        """One microbatch through every stage; the last stage's output on its rank, ``None`` elsewhere."""
        owner = self.partition.stage_ranks
        local = dict(zip(self.stage_indices, self.modules))
        x: Any = None
        for s in range(self.partition.num_stages):
            if owner[s] != self.rank:
                if s > 0 and owner[s - 1] == self.rank:
                    self._send(x, owner[s])
                continue
            if s == 0:
                args = first_args
            elif owner[s - 1] != self.rank:
                args = self._recv(owner[s - 1])
            else:
                args = x if isinstance(x, tuple) else (x,)
            x = local[s](*args)
        return x if owner[-1] == self.rank else None

    _DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)

    def _send(self, x: Any, to: int) -> None:
        tensors = x if isinstance(x, tuple) else (x,)
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.dim() > 8 or t.dtype not in self._DTYPES:
                raise TypeError(
                    "pipeline layers must pass a tensor or a tuple of tensors (each at most 8 dims, a float or int "
                    f"dtype: {', '.join(str(d) for d in self._DTYPES)}) between stages, got "
                    f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}"
                )
        peer = dist.get_global_rank(self.group, to)
        header = torch.zeros(1 + 10 * len(tensors), dtype=torch.int64)
        header[0] = len(tensors)
        for i, t in enumerate(tensors):
            row = header[1 + 10 * i: 11 + 10 * i]
            row[0], row[1] = t.dim(), self._DTYPES.index(t.dtype)
            row[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        count = header[:1].to(self.device)
        dist.send(count, dst=peer, group=self.group)
        dist.send(header[1:].to(self.device), dst=peer, group=self.group)
        for t in tensors:
            dist.send(t.contiguous(), dst=peer, group=self.group)

    def _recv(self, src: int) -> tuple[torch.Tensor, ...]:
        peer = dist.get_global_rank(self.group, src)
        count = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.recv(count, src=peer, group=self.group)
        header = torch.zeros(10 * int(count), dtype=torch.int64, device=self.device)
        dist.recv(header, src=peer, group=self.group)
        out = []
        for row in header.cpu().view(-1, 10).tolist():
            ndim, dtype = row[0], self._DTYPES[row[1]]
            t = torch.empty(row[2:2 + ndim], dtype=dtype, device=self.device)
            dist.recv(t, src=peer, group=self.group)
            out.append(t)
        return tuple(out)

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
