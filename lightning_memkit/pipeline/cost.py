"""Per-layer memory cost of pipeline training, and how many microbatches each schedule keeps in flight.

A pipeline rank holds, for each of its stages, the stage's parameters, their gradients and the optimizer
state (static bytes, :class:`LayerCost`), plus the activations of every microbatch that went forward
through the stage and has not come back in backward yet. Stage ``i`` of a 1F1B pipeline keeps up to
``P - i`` microbatches; GPipe keeps all of them everywhere; DualPipeV puts a cheap and an expensive stage
on every rank. :func:`inflight_microbatches` gives that count per stage for each schedule that
``torch.distributed.pipelining`` ships; :mod:`lightning_memkit.pipeline.partition` combines the two.

In-flight counts (``N`` stages, ``P`` ranks, ``M`` microbatches, stage ``s``); each follows from the
order of forward (F) and backward (B, or W for the weight half of a split backward) on a rank, counting
the forwards of a stage not yet matched by its B/W:

* ``gpipe``: every rank runs all ``M`` forwards before the first backward: ``M`` on every stage.
* ``1f1b``: rank ``s`` runs ``min(P - s, M)`` warm-up forwards, then alternates one backward, one
  forward, so the count never grows past the warm-up: ``min(P - s, M)``.
* ``zbv`` and ``dualpipev`` (two stages per rank, V order: rank ``r`` holds stages ``r`` and
  ``2P - 1 - r``): a V pipeline of ``N = 2P`` stages behaves like a 1F1B pipeline of ``N`` stages, the
  warm-up shrinks by one per stage along the V: ``min(N - s, M)``. Rank ``r`` therefore holds
  ``min(2P - r, M) + min(r + 1, M)`` microbatch-stages, the same total on every rank: the V balances
  the *count*, not the bytes, which differ when the first and last stages carry the embedding and head.
* ``interleaved_1f1b`` (``v`` stages per rank, loop order: stage ``s`` on rank ``s mod P``): rank ``r``
  runs ``W_r = min((v - 1) * R + 2 * (P - 1 - r), v * M)`` warm-up forwards (``R = M / max(1, M // P)``
  microbatches per round), forwards cycling through its local stages every ``R`` microbatches, then
  alternates F and B, backwards cycling through the local stages in reverse. The count is the running
  maximum of (forwards - backwards) per stage along that order; :func:`inflight_microbatches` walks it.

A rank's activation peak is taken as the sum of its stages' counts times their per-microbatch bytes, a
bound that is exact when one stage per rank and may exceed the true joint peak by one microbatch of a
stage for two stages per rank (the two stages peak at nearly the same time).

With ``D > 1`` data-parallel replicas (DDP), every rank averages its gradients over its stage's replicas
before the optimizer step (:func:`~lightning_memkit.pipeline.gradients.average_gradients`): consecutive
gradients of one dtype are concatenated into a flat buffer of at most ``bucket_bytes`` (a larger gradient
alone), all-reduced and copied back, one bucket at a time. That happens after the last backward, when no
activation is left but every gradient is, so a rank peaks at the larger of the two phases; the buffer is
:func:`allreduce_buffer_bytes`.

Example::

    >>> from lightning_memkit.pipeline import inflight_microbatches
    >>> inflight_microbatches("1f1b", num_stages=4, microbatches=8)
    (4, 3, 2, 1)
    >>> inflight_microbatches("dualpipev", num_stages=8, microbatches=8)
    (8, 7, 6, 5, 4, 3, 2, 1)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_memkit.common.validation import check_int
from lightning_memkit.measure.live_peak import LivePeak
from lightning_memkit.measure.saved_tensors import SavedTensorRecorder
from lightning_memkit.measure.storage import iter_tensors, unique_storage_bytes
from lightning_memkit.pipeline.gradients import BUCKET_BYTES

__all__ = [
    "SCHEDULES",
    "LayerCost",
    "as_layer_costs",
    "resolve_stages_per_rank",
    "stage_to_rank",
    "inflight_microbatches",
    "optimizer_state_bytes",
    "optimizer_step_bytes",
    "allreduce_buffer_bytes",
    "static_cost",
    "shared_parameter_costs",
    "measure_layer_costs",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")
_V_SCHEDULES = ("zbv", "dualpipev")
_STEP_BYTES = 4  # the fp32 scalar ``step`` tensor that Adam-family optimizers keep per parameter


@dataclass(frozen=True)
class LayerCost:
    """Bytes one layer costs a pipeline stage.

    Static (held for the whole step): ``param_bytes``, ``grad_bytes``, ``optimizer_bytes``.
    Per microbatch in flight: ``activation_bytes`` (storages the layer's forward creates and autograd
    keeps for backward, its output excluded) and, when the output is kept too, ``output_bytes``.

    Args:
        param_bytes, grad_bytes, optimizer_bytes: static bytes.
        activation_bytes: bytes kept for backward per microbatch, excluding the layer's output and input.
        output_bytes: bytes of the layer's output per microbatch (what crosses a stage boundary).
        workspace_bytes: transient bytes while the layer runs backward (gradients of intermediates).
        loss_workspace_bytes: transient bytes of the loss's backward that precedes the layer's own (the last
            layer with a loss); ``workspace_bytes`` then covers the layer's own backward only.
        saves_input: whether the layer's backward needs its input (so the previous layer's output stays).
        saves_output: whether the layer's backward needs its own output.
        largest_grad_bytes: bytes of the layer's largest single gradient (at most ``grad_bytes``); a gradient
            larger than the data-parallel all-reduce bucket is reduced in a buffer of its own size.
        step_bytes: transient bytes of the optimizer step over the layer's parameters
            (:func:`optimizer_step_bytes`).
        step_foreach: whether that step is a ``foreach`` step, whose temporaries of all parameters of a rank
            coexist (they add up over layers); otherwise one parameter is updated at a time (the largest counts).

    Example::

        >>> from lightning_memkit.pipeline import LayerCost
        >>> LayerCost(param_bytes=400, grad_bytes=400, optimizer_bytes=800, activation_bytes=64).static_bytes
        1600
    """

    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes: int = 0
    output_bytes: int = 0
    workspace_bytes: int = 0
    loss_workspace_bytes: int = 0
    saves_input: bool = False
    saves_output: bool = False
    largest_grad_bytes: int = 0
    step_bytes: int = 0
    step_foreach: bool = False

    def __post_init__(self) -> None:
        for name in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "output_bytes",
                     "workspace_bytes", "loss_workspace_bytes", "largest_grad_bytes", "step_bytes"):
            check_int(getattr(self, name), name, minimum=0, owner="LayerCost")  # bytes
        for name in ("saves_input", "saves_output", "step_foreach"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LayerCost({name}=...) must be a bool, got {type(getattr(self, name)).__name__}")
        if self.largest_grad_bytes > self.grad_bytes:
            raise ValueError(
                f"LayerCost(largest_grad_bytes={self.largest_grad_bytes}) exceeds grad_bytes={self.grad_bytes}: one "
                "gradient cannot be larger than all of them"
            )

    @property
    def static_bytes(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def as_layer_costs(costs: Sequence[LayerCost | int]) -> list[LayerCost]:
    """Normalize ``costs``: a plain int is a layer of that many static bytes and no activations."""
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Sequence):
        raise TypeError(f"costs must be a sequence of LayerCost or int, got {type(costs).__name__}")
    out = []
    for i, c in enumerate(costs):
        if isinstance(c, LayerCost):
            out.append(c)
        elif isinstance(c, int) and not isinstance(c, bool):
            if c < 0:
                raise ValueError(f"costs[{i}]={c} must be >= 0 bytes")
            out.append(LayerCost(param_bytes=c))
        else:
            raise TypeError(f"costs[{i}] must be a LayerCost or an int (static bytes), got {type(c).__name__}")
    if not out:
        raise ValueError("costs is empty: need at least one layer")
    return out


def _check_schedule(schedule: str) -> str:
    if not isinstance(schedule, str) or schedule.lower() not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not supported; allowed: {', '.join(map(repr, SCHEDULES))}")
    return schedule.lower()


def resolve_stages_per_rank(schedule: str, stages_per_rank: int | None = None) -> int:
    """Stages each rank holds: 1 for ``gpipe``/``1f1b``, 2 for ``zbv``/``dualpipev``, >= 2 for interleaved."""
    schedule = _check_schedule(schedule)
    check_int(stages_per_rank, "stages_per_rank", allow_none=True)
    fixed = {"gpipe": 1, "1f1b": 1, "zbv": 2, "dualpipev": 2}
    if schedule in fixed:
        if stages_per_rank not in (None, fixed[schedule]):
            raise ValueError(
                f"stages_per_rank={stages_per_rank} does not fit schedule={schedule!r}, which puts exactly "
                f"{fixed[schedule]} stage(s) on each rank"
            )
        return fixed[schedule]
    if stages_per_rank is None:
        return 2
    if stages_per_rank < 2:
        raise ValueError(f"stages_per_rank={stages_per_rank}: 'interleaved_1f1b' needs at least 2 stages per rank")
    return stages_per_rank


def _ranks(schedule: str, num_stages: int, stages_per_rank: int | None, owner: str) -> tuple[str, int, int]:
    schedule = _check_schedule(schedule)
    check_int(num_stages, "num_stages", minimum=1, owner=owner)
    v = resolve_stages_per_rank(schedule, stages_per_rank)
    if num_stages % v:
        raise ValueError(
            f"num_stages={num_stages} must be a multiple of the {v} stages per rank that schedule={schedule!r} uses"
        )
    return schedule, v, num_stages // v


def stage_to_rank(schedule: str, num_stages: int, stages_per_rank: int | None = None) -> tuple[int, ...]:
    """Rank of each stage: ``s`` for one stage per rank, ``s mod P`` for interleaved, a V for zbv/dualpipev.

    Example::

        >>> from lightning_memkit.pipeline import stage_to_rank
        >>> stage_to_rank("dualpipev", 6)
        (0, 1, 2, 2, 1, 0)
    """
    schedule, v, p = _ranks(schedule, num_stages, stages_per_rank, "stage_to_rank")
    if schedule in _V_SCHEDULES:
        return tuple(s if s < p else 2 * p - 1 - s for s in range(num_stages))
    return tuple(s % p for s in range(num_stages))


def _check_microbatches(microbatches: int, owner: str) -> int:
    return check_int(microbatches, "microbatches", minimum=1, owner=owner)


def inflight_microbatches(
    schedule: str, num_stages: int, microbatches: int, stages_per_rank: int | None = None
) -> tuple[int, ...]:
    """Most microbatches whose activations stage ``s`` holds at once, for each stage (see the module doc)."""
    schedule, v, p = _ranks(schedule, num_stages, stages_per_rank, "inflight_microbatches")
    m = _check_microbatches(microbatches, "inflight_microbatches")
    if schedule == "gpipe":
        return (m,) * num_stages
    if schedule == "1f1b" or schedule in _V_SCHEDULES:
        return tuple(min(num_stages - s, m) for s in range(num_stages))
    return _interleaved_inflight(p, v, m)


def _interleaved_inflight(p: int, v: int, m: int) -> tuple[int, ...]:
    """Walk the interleaved 1F1B order of each rank (depth first, ``R`` microbatches per round)."""
    rounds = max(1, m // p)
    if m % rounds:
        raise ValueError(
            f"microbatches={m} must be a multiple of the number of rounds {rounds} (= max(1, microbatches // "
            f"{p} ranks)) for 'interleaved_1f1b'"
        )
    per_round = m // rounds
    peak = [0] * (p * v)
    for r in range(p):
        warmup = min((v - 1) * per_round + 2 * (p - 1 - r), m * v)
        live = [0] * v
        for op in range(m * v + warmup):
            if op < m * v:  # a forward (warm-up, then one per 1F1B step)
                local = (op // per_round) % v
                live[local] += 1
                peak[local * p + r] = max(peak[local * p + r], live[local])
            if op >= warmup:  # a backward (1F1B step, then cool-down)
                live[v - 1 - ((op - warmup) // per_round) % v] -= 1
    return tuple(peak)


# -- static bytes -----------------------------------------------------------------------------------------
_OPTIMIZERS = ("sgd", "adam", "adamw", "adamax", "nadam", "radam", "adagrad", "adadelta", "rmsprop", "none")


def _state_factor(name: str, hp: dict[str, Any]) -> tuple[int, int]:
    """(full-size state tensors per parameter, scalar fp32 bytes per parameter) for optimizer ``name``."""
    if name == "none":
        return 0, 0
    if name == "sgd":
        return (1 if hp.get("momentum", 0) else 0), 0
    if name in ("adam", "adamw"):
        return (3 if hp.get("amsgrad", False) else 2), _STEP_BYTES
    if name in ("adamax", "radam"):
        return 2, _STEP_BYTES
    if name == "nadam":
        return 2, 2 * _STEP_BYTES  # step and mu_product
    if name == "adagrad":
        return 1, _STEP_BYTES
    if name == "adadelta":
        return 2, _STEP_BYTES
    if name == "rmsprop":
        return 1 + (1 if hp.get("momentum", 0) else 0) + (1 if hp.get("centered", False) else 0), _STEP_BYTES
    raise AssertionError(name)


def _optimizer_name(optimizer: Any) -> str:
    if isinstance(optimizer, str):
        name = optimizer.lower()
    elif isinstance(optimizer, torch.optim.Optimizer):
        name = type(optimizer).__name__.lower()
    elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        name = optimizer.__name__.lower()
    else:
        raise TypeError(
            f"optimizer must be a name, a torch.optim.Optimizer subclass or instance, got {type(optimizer).__name__}"
        )
    if name not in _OPTIMIZERS:
        raise ValueError(f"optimizer={name!r} has no known state size; allowed: {', '.join(map(repr, _OPTIMIZERS))}")
    return name


def optimizer_state_bytes(
    params: torch.Tensor | Iterable[torch.Tensor],
    optimizer: str | type | torch.optim.Optimizer = "adamw",
    *,
    master_weights: bool = False,
    **hyperparams: Any,
) -> int:
    """Bytes of optimizer state for ``params`` (those that require grad) once the optimizer has stepped.

    Per parameter: SGD keeps a momentum buffer when ``momentum != 0``; Adam/AdamW keep ``exp_avg`` and
    ``exp_avg_sq`` (plus ``max_exp_avg_sq`` with ``amsgrad``) and a 4-byte ``step``; Adagrad, Adadelta,
    Adamax, NAdam, RAdam and RMSprop (``momentum``, ``centered``) likewise. States have the parameter's
    dtype; ``master_weights=True`` adds an fp32 master copy and keeps the states in fp32 (mixed-precision
    training with low-precision parameters).

    ``optimizer`` may be an instance: the hyperparameters then come from each parameter's group (a
    parameter in no group costs nothing); with a name or class they come from ``hyperparams``.

    Example::

        >>> import torch
        >>> from lightning_memkit.pipeline import optimizer_state_bytes
        >>> w = torch.nn.Parameter(torch.zeros(10, 10))
        >>> optimizer_state_bytes([w], "adamw"), optimizer_state_bytes([w], "sgd", momentum=0.9)
        (804, 400)
    """
    name = _optimizer_name(optimizer)
    if not isinstance(master_weights, bool):
        raise TypeError(f"master_weights must be a bool, got {type(master_weights).__name__}")
    groups: dict[int, dict[str, Any]] | None = None
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    total = 0
    for p in _unique(params):
        if not p.requires_grad:
            continue
        hp = hyperparams
        if groups is not None:
            if id(p) not in groups:
                continue
            hp = groups[id(p)]
        full, scalar = _state_factor(name, hp)
        state_elem = 4 if master_weights else p.element_size()
        total += p.numel() * state_elem * full + scalar
        if master_weights:
            total += p.numel() * 4
    return total


def _uses_foreach(p: torch.Tensor, group: dict[str, Any]) -> bool:
    foreach = group.get("foreach")
    if foreach is None:  # torch's default: foreach on CUDA, one parameter at a time elsewhere
        return p.device.type == "cuda" and not group.get("fused") and not group.get("differentiable")
    return bool(foreach)


def optimizer_step_bytes(
    params: torch.Tensor | Iterable[torch.Tensor],
    optimizer: str | type | torch.optim.Optimizer = "adamw",
    *,
    foreach: bool | None = None,
    **hyperparams: Any,
) -> int:
    """Peak temporary bytes that ``optimizer.step()`` allocates for ``params`` (state already created).

    ``b_i`` are the bytes of the ``i``-th parameter that requires grad, in order. One parameter at a time
    (``foreach=False``, torch's default off CUDA):

    * Adam/AdamW: ``max_i(k * b_i + b_{i-1})``: the square root of ``exp_avg_sq`` and the denominator
      (``k = 2``), plus a copy of the gradient (``k = 3``) with ``maximize`` or Adam's ``weight_decay``;
      the previous parameter's denominator is still referenced (``b_{-1} = 0``).
    * SGD: ``max_i(k * b_i)``, ``k = min(2, maximize + (weight_decay != 0) + nesterov)`` gradient copies.

    ``foreach=True`` (torch's default on CUDA): Adam/AdamW ``sum_i b_i``; SGD ``sum_i b_i`` with ``maximize``
    or ``weight_decay``, else 0. Other optimizers (and ``"none"``) are not modeled: 0. ``foreach=None``
    picks torch's default for the parameters' device. With an instance, the hyperparameters and ``foreach``
    come from each parameter's group, which is stepped separately.

    Example::

        >>> import torch
        >>> from lightning_memkit.pipeline.cost import optimizer_step_bytes
        >>> ps = [torch.nn.Parameter(torch.zeros(10, 10)), torch.nn.Parameter(torch.zeros(10))]
        >>> optimizer_step_bytes(ps, "adamw"), optimizer_step_bytes(ps, "adamw", foreach=True)
        (800, 440)
    """
    name = _optimizer_name(optimizer)
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"foreach must be a bool or None, got {type(foreach).__name__}")
    params = [p for p in _unique(params) if p.requires_grad]
    if isinstance(optimizer, torch.optim.Optimizer):
        ids = {id(p) for p in params}
        groups = [(g, [p for p in g["params"] if id(p) in ids]) for g in optimizer.param_groups]
    else:
        groups = [({**hyperparams, "foreach": foreach}, params)]
    return max((_group_step_bytes(name, g, ps) for g, ps in groups if ps), default=0)


def _group_step_bytes(name: str, hp: dict[str, Any], params: list[torch.Tensor]) -> int:
    sizes = [p.numel() * p.element_size() for p in params]
    maximize = bool(hp.get("maximize", False))
    decay = bool(hp.get("weight_decay", 0))
    if _uses_foreach(params[0], hp):
        if name in ("adam", "adamw") or (name == "sgd" and (maximize or decay)):
            return sum(sizes)
        return 0
    if name in ("adam", "adamw"):
        k = 3 if maximize or (name == "adam" and decay) else 2
        return max(k * b + prev for b, prev in zip(sizes, [0, *sizes[:-1]]))
    if name == "sgd":
        return min(2, maximize + decay + bool(hp.get("nesterov", False))) * max(sizes)
    return 0


def allreduce_buffer_bytes(
    grad_bytes: int,
    largest_grad_bytes: int = 0,
    *,
    data_parallel_size: int,
    bucket_bytes: int = BUCKET_BYTES,
) -> int:
    """Largest flat buffer that averaging a rank's gradients over ``data_parallel_size`` replicas allocates.

    :func:`~lightning_memkit.pipeline.gradients.average_gradients` reduces consecutive gradients of one dtype
    in flat buffers of at most ``bucket_bytes`` (a larger gradient alone), one at a time. The largest is
    ``max(min(grad_bytes, bucket_bytes), largest_grad_bytes)``: exact when the rank's gradients (of one dtype)
    fit one bucket or the largest gradient exceeds a bucket, otherwise an upper bound by less than the largest
    gradient (a bucket closes before the gradient that would overflow it). ``0`` for one replica (nothing is
    reduced) or no gradients.

    Example::

        >>> from lightning_memkit.pipeline.cost import allreduce_buffer_bytes
        >>> allreduce_buffer_bytes(8 * 2**20, 2**20, data_parallel_size=2)  # every gradient in one bucket
        8388608
        >>> allreduce_buffer_bytes(8 * 2**20, 2**20, data_parallel_size=1)
        0
    """
    owner = "allreduce_buffer_bytes"
    check_int(grad_bytes, "grad_bytes", minimum=0, owner=owner)
    check_int(largest_grad_bytes, "largest_grad_bytes", minimum=0, owner=owner)
    check_int(data_parallel_size, "data_parallel_size", minimum=1, owner=owner)
    check_int(bucket_bytes, "bucket_bytes", minimum=1, owner=owner)
    if largest_grad_bytes > grad_bytes:
        raise ValueError(f"{owner}(largest_grad_bytes={largest_grad_bytes}) exceeds grad_bytes={grad_bytes}")
    if data_parallel_size == 1:
        return 0
    return max(min(grad_bytes, bucket_bytes), largest_grad_bytes)


def _unique(params: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        params = [params]
    seen, out = set(), []
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params must hold tensors, got {type(p).__name__}")
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def static_cost(
    module: nn.Module,
    optimizer: str | type | torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = "adamw",
    *,
    master_weights: bool = False,
    **hyperparams: Any,
) -> LayerCost:
    """A :class:`LayerCost` with the static bytes of ``module``: parameters and buffers, gradients, optimizer state.

    ``optimizer`` may also be a list of optimizer instances (their states add up) or ``None`` (no state).
    ``step_bytes`` is :func:`optimizer_step_bytes` of the module's parameters (``foreach`` may be among
    ``hyperparams``).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    params = _unique(module.parameters())
    tensors = _unique([*params, *module.buffers()])
    param_bytes = sum(t.numel() * t.element_size() for t in tensors)
    grads = [p.numel() * p.element_size() for p in params if p.requires_grad]
    step, foreach = 0, False
    if optimizer is None:
        opt_bytes = 0
    elif isinstance(optimizer, Sequence) and not isinstance(optimizer, str):
        opt_bytes = sum(optimizer_state_bytes(params, o, master_weights=master_weights) for o in optimizer)
        step = max((optimizer_step_bytes(params, o) for o in optimizer), default=0)
        foreach = any(_uses_foreach(p, g) for o in optimizer for g in o.param_groups for p in g["params"][:1])
    else:
        opt_bytes = optimizer_state_bytes(params, optimizer, master_weights=master_weights, **hyperparams)
        step = optimizer_step_bytes(params, optimizer, **hyperparams)
        if isinstance(optimizer, torch.optim.Optimizer):
            foreach = any(_uses_foreach(p, g) for g in optimizer.param_groups for p in g["params"][:1])
        elif params:
            foreach = _uses_foreach(params[0], hyperparams)
    return LayerCost(param_bytes=param_bytes, grad_bytes=sum(grads), optimizer_bytes=opt_bytes,
                     largest_grad_bytes=max(grads, default=0), step_bytes=step, step_foreach=foreach)


def shared_parameter_costs(
    layers: Sequence[nn.Module],
    optimizer: str | type | torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = "adamw",
    **kwargs: Any,
) -> list[tuple[int, int, LayerCost]]:
    """``(i, j, cost)`` for each pair of layers ``i < j`` that share parameters (tied input and output embeddings),
    ``i`` the first layer holding them: ``cost`` is :func:`static_cost` of the shared parameters, which both layers'
    costs count (the ``ties`` of :func:`~lightning_memkit.pipeline.partition_layers`). ``kwargs`` as
    :func:`static_cost`'s.

    Example::

        >>> from torch import nn
        >>> from lightning_memkit.pipeline.cost import shared_parameter_costs
        >>> emb, head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
        >>> head.weight = emb.weight
        >>> [(i, j, c.static_bytes) for i, j, c in shared_parameter_costs([emb, nn.Linear(4, 4), head], "sgd")]
        [(0, 2, 256)]
    """
    first: dict[int, int] = {}
    shared: dict[tuple[int, int], list[nn.Parameter]] = {}
    for j, layer in enumerate(layers):
        for p in _unique(layer.parameters()):
            i = first.setdefault(id(p), j)
            if i != j:
                shared.setdefault((i, j), []).append(p)
    return [(i, j, static_cost(nn.ParameterList(params), optimizer, **kwargs)) for (i, j), params in shared.items()]


# -- activation bytes -------------------------------------------------------------------------------------
class _LossLayer(nn.Module):
    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], target: Any):
        super().__init__()
        self.loss_fn, self.target = loss_fn, target

    def forward(self, output: Any) -> torch.Tensor:
        return self.loss_fn(output, self.target)


def _fresh_input(x: Any) -> Any:
    """``x`` as the next stage receives it: a detached leaf that requires grad when it is floating point."""
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.is_floating_point() and x.requires_grad)
    if isinstance(x, (tuple, list)):
        return type(x)(_fresh_input(t) for t in x)
    return x


def _backward_workspace(module: nn.Module, output: Any, loss: torch.Tensor | None, lp: LivePeak) -> tuple[int, int]:
    """Peak bytes of the layer's backward and of the loss's before it, above those alive when backward starts.

    ``lp`` tracked the forward, so the saved activations backward frees count against what it allocates;
    gradients are preallocated and accumulated in place.
    """
    params = [p for p in _unique(module.parameters()) if p.requires_grad]
    previous = [p.grad for p in params]
    outs = [t for t in iter_tensors(output) if t.requires_grad]
    if not outs:
        return 0, 0
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        seeds = [torch.ones_like(t) for t in outs] if loss is None else None
        lp.reset_peak()
        start = lp.live_bytes
        loss_peak = 0
        if loss is not None:  # the loss's backward down to the layer's output, then the layer's own
            seeds = list(torch.autograd.grad(loss, outs, allow_unused=True))
            loss_peak = max(0, lp.peak_bytes - start)
            outs, seeds = zip(*[(t, g) for t, g in zip(outs, seeds) if g is not None]) if any(
                g is not None for g in seeds) else ((), ())
            lp.reset_peak()
        if outs:
            torch.autograd.backward(list(outs), list(seeds))
        return max(0, lp.peak_bytes - start), loss_peak
    finally:
        for p, g in zip(params, previous):
            p.grad = g


def measure_layer_costs(
    layers: Sequence[nn.Module],
    sample_input: Any,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    optimizer: str | type | torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = "adamw",
    master_weights: bool = False,
    device: torch.device | str | None = None,
    **hyperparams: Any,
) -> list[LayerCost]:
    """Measure each layer's :class:`LayerCost` on one sample microbatch, in order.

    Each layer runs forward once on the previous layer's output (detached, as a pipeline stage receives
    it; a tuple is passed as positional arguments, as :class:`~lightning_memkit.pipeline.runtime.LayerChain`
    does) under :class:`~lightning_memkit.measure.saved_tensors.SavedTensorRecorder`, which reports the bytes
    kept for backward; then backward runs under :class:`~lightning_memkit.memory.LivePeak` to measure the
    transient workspace: the peak above the bytes alive when backward starts, net of the saved activations
    backward frees on the way (LivePeak also tracks the forward). With ``loss_fn`` (called as
    ``loss_fn(last_output, target)``) the loss's saved bytes join the last layer, and its backward is measured
    apart (``loss_workspace_bytes``), before the layer's own. Gradients the
    measurement creates are removed again. With ``device``, each layer moves there for its own measurement
    and back afterwards (so only one layer at a time occupies the device); ``sample_input`` and ``target``
    must already be there.

    Example::

        >>> import torch
        >>> from lightning_memkit.pipeline import measure_layer_costs
        >>> layers = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)]
        >>> costs = measure_layer_costs(layers, torch.randn(2, 8), optimizer="sgd")
        >>> [c.output_bytes for c in costs], costs[1].saves_output, costs[2].saves_input
        ([128, 128, 32], True, True)
    """
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise TypeError("layers must be a sequence of modules (nn.ModuleList, nn.Sequential or a list)")
    layers = list(layers)
    if not layers:
        raise ValueError("layers is empty: need at least one layer")
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layers[{i}] must be a torch.nn.Module, got {type(layer).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
    if (loss_fn is None) != (target is None):
        raise ValueError("pass loss_fn and target together (or neither)")
    costs: list[LayerCost] = []
    x = sample_input
    with torch.enable_grad():
        for i, layer in enumerate(layers):
            home = _device_of(layer)
            if device is not None:
                layer.to(device)
            inp = _fresh_input(x)
            lp = LivePeak().__enter__()
            with SavedTensorRecorder(layer) as rec:
                out = layer(*inp) if isinstance(inp, tuple) else layer(inp)
                rec.stop()
            report = rec.report(output=out)
            activation = report.new_activation_bytes
            loss = None
            if loss_fn is not None and i == len(layers) - 1:
                loss_layer = _LossLayer(loss_fn, target)
                with SavedTensorRecorder(loss_layer) as loss_rec:
                    loss = loss_layer(out)
                    loss_rec.stop()
                loss_report = loss_rec.report(output=loss)
                activation += loss_report.new_activation_bytes
            try:
                workspace, loss_workspace = _backward_workspace(layer, out, loss, lp)
            finally:
                lp.__exit__(None, None, None)
            cost = static_cost(layer, optimizer, master_weights=master_weights, **hyperparams)
            costs.append(
                replace(
                    cost,
                    activation_bytes=activation,
                    output_bytes=unique_storage_bytes(out),
                    workspace_bytes=workspace,
                    loss_workspace_bytes=loss_workspace,
                    saves_input=report.preexisting_bytes > 0,
                    saves_output=report.output_bytes > 0,
                )
            )
            x = _detach(out)
            del out, loss, rec
            if device is not None and home is not None:
                layer.to(home)
    return costs


def _device_of(module: nn.Module) -> torch.device | None:
    for t in [*module.parameters(), *module.buffers()]:
        return t.device
    return None


def _detach(x: Any) -> Any:
    """``x`` cut from its graph; a tensor that required grad still does (as the next stage receives it)."""
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.is_floating_point() and x.requires_grad)
    if isinstance(x, (tuple, list)):
        return type(x)(_detach(t) for t in x)
    return x
