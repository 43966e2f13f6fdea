"""Split an ordered list of layers into contiguous pipeline stages so that the fullest rank is as light as possible.

A stage ``s`` that owns layers ``[a, b)`` is predicted to peak at::

    static(a, b)                         parameters + gradients + optimizer state of its layers
  + M * output[a - 1]      (s > 0)       receive buffers: torch allocates one input buffer per microbatch
  + M * output[b - 1]      (s < N - 1)   and one buffer per microbatch for the gradient of its output
  + max(n_s * per_microbatch(a, b)       n_s = inflight_microbatches(schedule, ...)[s]
        + backward(a, b),                transient bytes of one layer's backward (below)
        allreduce(a, b),                 D > 1 replicas: the gradient all-reduce buffer before the step
        step(a, b))                      the optimizer step's temporaries

where ``per_microbatch(a, b)`` adds the layers' ``activation_bytes``, the outputs that stay alive inside the
stage (a layer saves its output or the next layer saves its input) and the stage's own output (held until its
backward), and ``allreduce(a, b)`` is :func:`~lightning_memkit.pipeline.cost.allreduce_buffer_bytes` of the
stage's gradients (``0`` for one replica, so ``data_parallel_size=1`` is the pipeline alone): the all-reduce
runs after the last backward, when the activations are gone and the buffers and gradients are not.
``backward(a, b)`` is the largest, over the stage's layers ``l``, of ``workspace_bytes[l]`` (or
``loss_workspace_bytes[l]``) less the per-microbatch bytes of the layers after ``l`` (already freed by the
backward of the microbatch, when ``l``'s runs). ``step(a, b)`` is the largest ``step_bytes`` of its layers
plus the sum of those with ``step_foreach`` (see
:func:`~lightning_memkit.pipeline.cost.optimizer_step_bytes`): the step runs after the reduction, with
gradients and optimizer state alive and no activation (for Adam one at a time, the previous layer's last
denominator, alive while a layer's first parameter is updated, is not counted).

With ``sharded=True`` (PP x FSDP2, each layer one unit, as ``shard_stage_modules``), torch's ``PipelineStage``
runs every backward without gradient reduction and without resharding, and reduce-scatters once after the
last: a stage holds ``ceil((param + optimizer) / D)`` bytes per layer, full unsharded gradients during the
backwards, and, when layer ``l`` runs backward, the gathered parameters of layers ``l..b-1`` (each layer's
forward reshards it again, its backward gathers it) with a workspace of at least ``param_bytes[l]`` (the
all-gather output while it is copied into the unsharded parameters); the step sees ``ceil(grad / D)`` sharded
gradients and ``ceil(step / D)`` temporaries. Dimension-0 padding of uneven shards is not counted.

A rank's peak is the sum over its stages (exact for one stage per rank; for two, an upper bound of the
rank's single all-reduce). ``ties`` names layers that share parameters (tied input and output embeddings, as
:func:`~lightning_memkit.pipeline.cost.shared_parameter_costs` finds them): their static bytes are in both
layers' costs, and a rank that always holds both pays them once. That is the case for the first and the last
layer under ``zbv``/``dualpipev`` (rank 0 holds both ends of the V) and for every tie with one rank; the shared
bytes then come off stage 0 (the stage of layer 0). Other ties are counted in both layers (where two ranks hold
them, each holds a copy).
:func:`partition_layers` returns the contiguous split that minimizes the largest rank peak, exactly, by
dynamic programming: left to right for one stage per rank (``O(N L^2)``), outside-in for the V order of
``zbv``/``dualpipev`` (rank ``r`` owns the ``r``-th stage from each end, ``O(P L^4)``), and two chunks
side by side for ``interleaved_1f1b`` with two stages per rank (``O(P L^5)``, vectorized). The baselines
:func:`uniform_partition` (equal layer counts, as torchtitan and DeepSpeed ``"uniform"``) and
:func:`parameter_balanced_partition` (equal trainable bytes per stage, as DeepSpeed ``"parameters"``)
are scored with the same model.

Example (an embedding and a head heavy in weights around blocks heavy in activations)::

    >>> from lightning_memkit.pipeline import LayerCost, partition_layers, uniform_partition
    >>> ends = LayerCost(param_bytes=1000, activation_bytes=10)
    >>> block = LayerCost(param_bytes=100, activation_bytes=100)
    >>> costs = [ends, *[block] * 8, ends]
    >>> p = partition_layers(costs, 3, schedule="1f1b", microbatches=6)
    >>> p.sizes, p.predicted_peak_bytes
    ((2, 5, 3), (1430, 1500, 1410))
    >>> uniform_partition(costs, 3, schedule="1f1b", microbatches=6).predicted_peak_bytes
    (2230, 900, 1410)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_memkit.common.validation import check_int
from lightning_memkit.pipeline.cost import (
    LayerCost,
    as_layer_costs,
    inflight_microbatches,
    resolve_stages_per_rank,
    stage_to_rank,
)
from lightning_memkit.pipeline.gradients import BUCKET_BYTES

__all__ = [
    "Partition",
    "partition_layers",
    "evaluate_partition",
    "uniform_partition",
    "parameter_balanced_partition",
    "stage_cost_matrix",
]

_INF = float("inf")


@dataclass(frozen=True)
class Partition:
    """A contiguous split of ``L`` layers into ``N`` stages and what each rank is predicted to hold.

    Attributes:
        sizes: layers per stage, in stage order (sums to ``L``).
        boundaries: ``N + 1`` layer indices; stage ``s`` owns layers ``boundaries[s]:boundaries[s + 1]``.
        stage_ranks: rank of each stage.
        predicted_peak_bytes: predicted peak bytes of each rank (the sum over its stages).
        stage_peak_bytes: predicted peak bytes of each stage.
        schedule, microbatches, stages_per_rank: the pipeline the prediction is for.
        method: ``"memory"``, ``"uniform"``, ``"parameters"`` or ``"given"``.
        data_parallel_size: replicas of the pipeline whose gradients each rank averages (1: none).
        sharded: whether each stage is sharded over the replicas (FSDP) rather than replicated (DDP).
    """

    sizes: tuple[int, ...]
    boundaries: tuple[int, ...]
    stage_ranks: tuple[int, ...]
    predicted_peak_bytes: tuple[int, ...]
    stage_peak_bytes: tuple[int, ...]
    schedule: str
    microbatches: int
    stages_per_rank: int
    method: str
    data_parallel_size: int = 1
    sharded: bool = False

    @property
    def num_stages(self) -> int:
        return len(self.sizes)

    @property
    def num_ranks(self) -> int:
        return len(self.predicted_peak_bytes)

    @property
    def max_peak_bytes(self) -> int:
        return max(self.predicted_peak_bytes)

    @property
    def imbalance(self) -> float:
        """Largest rank peak over the mean rank peak (1.0 is perfectly balanced)."""
        mean = sum(self.predicted_peak_bytes) / len(self.predicted_peak_bytes)
        return self.max_peak_bytes / mean if mean else 1.0

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """Stage indices held by ``rank``, in increasing order."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank={rank} is out of range for {self.num_ranks} ranks")
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == rank)

    def layers_of_stage(self, stage: int) -> range:
        """Layer indices of ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage={stage} is out of range for {self.num_stages} stages")
        return range(self.boundaries[stage], self.boundaries[stage + 1])


# -- the cost model ---------------------------------------------------------------------------------------
def _prefix(values: Sequence[int]) -> torch.Tensor:
    out = torch.zeros(len(values) + 1, dtype=torch.int64)
    if values:
        out[1:] = torch.tensor(list(values), dtype=torch.int64).cumsum(0)
    return out


def _check_dp(data_parallel_size, bucket_bytes, owner, sharded=False) -> tuple[int, int]:
    if not isinstance(sharded, bool):
        raise TypeError(f"{owner}(sharded=...) must be a bool, got {type(sharded).__name__}")
    return (check_int(data_parallel_size, "data_parallel_size", minimum=1, owner=owner),
            check_int(bucket_bytes, "bucket_bytes", minimum=1, owner=owner))


def _check_ties(ties, n: int, owner: str) -> list[tuple[int, int, LayerCost]]:
    """``ties`` as ``(i, j, LayerCost)`` with ``0 <= i < j < n``; an int cost is static bytes."""
    if isinstance(ties, (str, bytes)) or not isinstance(ties, Sequence):
        raise TypeError(f"{owner}(ties=...) must be a sequence of (layer, layer, cost), got {type(ties).__name__}")
    out = []
    for k, tie in enumerate(ties):
        if not isinstance(tie, (tuple, list)) or len(tie) != 3:
            raise TypeError(f"{owner}(ties[{k}]={tie!r}) must be a (layer, layer, cost) triple")
        i = check_int(tie[0], f"ties[{k}][0]", minimum=0, owner=owner)
        j = check_int(tie[1], f"ties[{k}][1]", minimum=0, owner=owner)
        if not i < j < n:
            raise ValueError(f"{owner}(ties[{k}]=({i}, {j}, ...)): need two layers i < j among the {n} layers")
        out.append((i, j, as_layer_costs([tie[2]])[0]))
    return out


def _together(ties, n: int, schedule: str, num_stages: int, v: int) -> LayerCost | None:
    """The summed static cost of the ties one rank always holds both ends of (see the module doc), or ``None``."""
    ranks = num_stages // v
    v_order = schedule.lower() in ("zbv", "dualpipev")
    held = [c for i, j, c in ties if ranks == 1 or (v_order and (i, j) == (0, n - 1))]
    if not held:
        return None
    return LayerCost(param_bytes=sum(c.param_bytes for c in held), grad_bytes=sum(c.grad_bytes for c in held),
                     optimizer_bytes=sum(c.optimizer_bytes for c in held))


def _check_common(costs, num_stages, schedule, microbatches, stages_per_rank, owner="partition_layers"):
    layers = as_layer_costs(costs)
    v = resolve_stages_per_rank(schedule, stages_per_rank)
    check_int(num_stages, "num_stages", minimum=1, owner=owner)
    if num_stages > len(layers):
        raise ValueError(
            f"num_stages={num_stages} exceeds the {len(layers)} layers: every stage needs at least one layer; "
            f"use at most {len(layers)} stages or split the model into more layers"
        )
    if microbatches is None:
        microbatches = num_stages
    inflight = inflight_microbatches(schedule, num_stages, microbatches, v)  # validates the rest
    ranks = stage_to_rank(schedule, num_stages, v)
    return layers, v, microbatches, inflight, ranks


def stage_cost_matrix(
    costs: Sequence[LayerCost | int],
    stage: int,
    num_stages: int,
    inflight: int,
    microbatches: int,
    *,
    data_parallel_size: int = 1,
    bucket_bytes: int = BUCKET_BYTES,
    sharded: bool = False,
) -> torch.Tensor:
    """``C[a, b]``: predicted peak bytes of ``stage`` owning layers ``[a, b)`` (float64; ``inf`` where ``a >= b``).

    ``data_parallel_size`` replicas average their gradients in all-reduce buckets of ``bucket_bytes``, or, with
    ``sharded``, each layer is an FSDP unit sharded over them (see the module doc).
    """
    dp, bucket = _check_dp(data_parallel_size, bucket_bytes, "stage_cost_matrix", sharded)
    layers = as_layer_costs(costs)
    n = len(layers)
    out = [c.output_bytes for c in layers]
    kept = [
        out[i] if (layers[i].saves_output or (i + 1 < n and layers[i + 1].saves_input)) else 0 for i in range(n)
    ]
    act = _prefix([c.activation_bytes for c in layers])
    kept_p = _prefix(kept)
    a = torch.arange(n + 1)[:, None]
    b = torch.arange(n + 1)[None, :]
    valid = a < b
    bm1 = (b - 1).clamp(min=0)
    out_t = torch.tensor(out, dtype=torch.int64)
    out_last = out_t[bm1.clamp(max=n - 1)].expand(n + 1, n + 1)
    per_mb = (act[b] - act[a]) + (kept_p[bm1] - kept_p[a.clamp(max=n)]).clamp(min=0) + out_last
    cost = _weights_cost(layers, a, b, dp, sharded)
    if stage > 0:
        out_prev = out_t[(a - 1).clamp(min=0, max=n - 1)].expand(n + 1, n + 1)
        cost = cost + microbatches * torch.where(a > 0, out_prev, torch.zeros_like(out_prev))
    if stage < num_stages - 1:
        cost = cost + microbatches * out_last
    params = _prefix([c.param_bytes for c in layers]) if sharded else None
    training = inflight * per_mb + _backward_peak(layers, kept, act, kept_p, a, b, n, params)
    if dp > 1 and not sharded:  # all-reduce buffer: max(min(grads, bucket), largest gradient), allreduce_buffer_bytes
        training = torch.maximum(training, _allreduce_cost(layers, a, b, bucket))
    training = torch.maximum(training, _step_cost(layers, a, b, dp, sharded))
    cost = cost + training
    return torch.where(valid, cost.double(), torch.full(cost.shape, _INF, dtype=torch.float64))


def _weights_cost(layers, a, b, dp: int, sharded: bool) -> torch.Tensor:
    """Bytes that stay for the whole step: weights, gradients and optimizer state (their shards under FSDP,
    with full gradients while the microbatches run backward)."""
    if sharded:
        shards = _prefix([-(-(c.param_bytes + c.optimizer_bytes) // dp) + c.grad_bytes for c in layers])
        return shards[b] - shards[a]
    static = _prefix([c.static_bytes for c in layers])
    return static[b] - static[a]


def _allreduce_cost(layers, a, b, bucket: int) -> torch.Tensor:
    """The DDP all-reduce buffer of layers ``[a, b)``: ``max(min(grads, bucket), largest gradient)``."""
    grads = _prefix([c.grad_bytes for c in layers])
    return torch.maximum((grads[b] - grads[a]).clamp(max=bucket), _range_max([c.largest_grad_bytes for c in layers]))


def _step_cost(layers, a, b, dp: int, sharded: bool) -> torch.Tensor:
    """The optimizer step's temporaries (the largest per-parameter one, plus foreach groups); under FSDP on
    shards, with sharded gradients in place of the full ones."""
    single = _range_max([0 if c.step_foreach else c.step_bytes for c in layers])
    grouped = _prefix([c.step_bytes if c.step_foreach else 0 for c in layers])
    step = single + (grouped[b] - grouped[a]).clamp(min=0)
    if sharded:
        grads = _prefix([c.grad_bytes for c in layers])
        shard_grads = _prefix([-(-c.grad_bytes // dp) for c in layers])
        step = -(-step // dp) + (shard_grads[b] - shard_grads[a]) - (grads[b] - grads[a])
    return step


def _backward_peak(layers, kept, act, kept_p, a, b, n, params=None) -> torch.Tensor:
    """``max over l in [a, b)`` of layer ``l``'s workspace less the per-microbatch bytes of layers ``l+1..b-1``.

    Those are their activations and the outputs kept inside the stage (layers ``l+1..b-2``); the stage's
    own output stays counted. With ``params`` (prefix sums, FSDP), plus the gathered parameters of layers
    ``l..b-1``, and the workspace is at least the layer's parameters (its all-gather buffer), except in the
    loss's backward (``loss_workspace_bytes``), which runs before the layer is gathered.
    """
    ws = torch.tensor([c.workspace_bytes for c in layers], dtype=torch.int64)
    loss_ws = torch.tensor([c.loss_workspace_bytes for c in layers], dtype=torch.int64)
    gathered = torch.zeros(n + 1, dtype=torch.int64) if params is None else params
    if params is not None:  # gathering layer l: the all-gather output next to its unsharded parameters
        own = params[1:] - params[:-1]
        ws = torch.maximum(ws, own)
        loss_ws = loss_ws - own  # the loss's backward runs before layer l is gathered
    ws = torch.maximum(ws, loss_ws)
    # l < b - 1: ws[l] - (act[b] - act[l+1]) - (kept_p[b-1] - kept_p[l+1]) + gathered[b] - gathered[l]
    q = ws + act[1:] + kept_p[1:] - gathered[:-1]
    inner = _range_max(q.tolist())  # inner[a, c] = max q[a:c]
    bm1 = (b - 1).clamp(min=0)
    lower = inner[a.clamp(max=n), bm1.clamp(max=n)] - act[b] - kept_p[bm1] + gathered[b]
    lower = torch.where(bm1 > a, lower, torch.full_like(lower, -(2**62)))
    last = (ws + gathered[1:] - gathered[:-1])[bm1.clamp(max=n - 1)].expand(n + 1, n + 1)
    return torch.maximum(lower, last).clamp(min=0)


def _range_max(values: Sequence[int]) -> torch.Tensor:
    """``R[a, b] = max(values[a:b])`` (0 where ``a >= b``)."""
    n = len(values)
    t = torch.tensor(values, dtype=torch.int64)
    out = torch.zeros(n + 1, n + 1, dtype=torch.int64)
    for i in range(n):
        out[i, i + 1:] = t[i:].cummax(0).values
    return out


def _matrices(layers, num_stages, inflight, microbatches, dp=1, bucket=BUCKET_BYTES, sharded=False, together=None
              ) -> list[torch.Tensor]:
    mats = [
        stage_cost_matrix(layers, s, num_stages, inflight[s], microbatches, data_parallel_size=dp, bucket_bytes=bucket,
                          sharded=sharded)
        for s in range(num_stages)
    ]
    if together is not None:  # stage 0 starts at layer 0 and sits on rank 0, which holds the other end too
        mats[0][0] -= float(_weights_cost([together], 0, 1, dp, sharded))
    return mats


def _finish(layers, boundaries, v, schedule, microbatches, inflight, ranks, method, dp=1, bucket=BUCKET_BYTES,
            sharded=False, together=None) -> Partition:
    mats = _matrices(layers, len(boundaries) - 1, inflight, microbatches, dp, bucket, sharded, together)
    stage_peaks = tuple(int(mats[s][boundaries[s], boundaries[s + 1]]) for s in range(len(boundaries) - 1))
    num_ranks = (len(boundaries) - 1) // v
    rank_peaks = [0] * num_ranks
    for s, r in enumerate(ranks):
        rank_peaks[r] += stage_peaks[s]
    return Partition(
        sizes=tuple(boundaries[s + 1] - boundaries[s] for s in range(len(boundaries) - 1)),
        boundaries=tuple(boundaries),
        stage_ranks=ranks,
        predicted_peak_bytes=tuple(rank_peaks),
        stage_peak_bytes=stage_peaks,
        schedule=schedule.lower(),
        microbatches=microbatches,
        stages_per_rank=v,
        method=method,
        data_parallel_size=dp,
        sharded=sharded,
    )


def _boundaries_from_sizes(sizes: Sequence[int], num_layers: int) -> list[int]:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
        raise TypeError(f"sizes must be a non-empty sequence of ints, got {sizes!r}")
    bounds = [0]
    for i, s in enumerate(sizes):
        check_int(s, f"sizes[{i}]", minimum=1, owner="evaluate_partition")  # every stage needs a layer
        bounds.append(bounds[-1] + s)
    if bounds[-1] != num_layers:
        raise ValueError(f"sizes={list(sizes)} add up to {bounds[-1]} layers, but there are {num_layers}")
    return bounds


def evaluate_partition(
    costs: Sequence[LayerCost | int],
    sizes: Sequence[int],
    *,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    stages_per_rank: int | None = None,
    method: str = "given",
    data_parallel_size: int = 1,
    bucket_bytes: int = BUCKET_BYTES,
    sharded: bool = False,
    ties: Sequence[tuple[int, int, LayerCost | int]] = (),
) -> Partition:
    """The :class:`Partition` (with predicted peaks) of a given split ``sizes`` (layers per stage).

    ``data_parallel_size``, ``bucket_bytes``, ``sharded`` and ``ties`` as in :func:`partition_layers`.

    Example::

        >>> from lightning_memkit.pipeline import evaluate_partition
        >>> evaluate_partition([5, 1, 1, 1], [2, 2], schedule="gpipe").predicted_peak_bytes
        (6, 2)
    """
    layers, v, microbatches, inflight, ranks = _check_common(
        costs, len(sizes) if isinstance(sizes, Sequence) else 0, schedule, microbatches, stages_per_rank,
        owner="evaluate_partition",
    )
    dp, bucket = _check_dp(data_parallel_size, bucket_bytes, "evaluate_partition", sharded)
    together = _together(_check_ties(ties, len(layers), "evaluate_partition"), len(layers), schedule, len(sizes), v)
    bounds = _boundaries_from_sizes(sizes, len(layers))
    return _finish(layers, bounds, v, schedule, microbatches, inflight, ranks, method, dp, bucket, sharded, together)


# -- exact minimax partition ------------------------------------------------------------------------------
class _Objective:
    """How a rank's cost joins the best cost of the remaining ranks.

    ``minimax``: ``max(rank, rest)``. ``refine`` (after the minimax value ``cap`` is known): the sum of squared
    rank costs over splits whose every rank stays within ``cap``, which picks, among the optimal splits, the
    most even one. Costs are float64 (exact below 2**53 bytes); ``inf`` marks an impossible split.
    """

    def __init__(self, cap: float | None = None, splits: dict[int, float] | None = None):
        self.cap = cap
        self.splits = {} if splits is None else splits  # interleaved: best value per chunk split (minimax pass)

    def leaf(self, cost: torch.Tensor) -> torch.Tensor:
        if self.cap is None:
            return cost
        return torch.where(cost <= self.cap, cost * cost, torch.full_like(cost, _INF))

    def join(self, cost: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        if self.cap is None:
            return torch.maximum(cost, rest)
        return self.leaf(cost) + rest


def _solve_single(mats: list[torch.Tensor], n: int, obj: _Objective) -> tuple[float, list[int]]:
    """One stage per rank: ``F_s[b] = min_a join(C_s[a, b], F_{s-1}[a])``."""
    f = obj.leaf(mats[0][0])
    choices = []
    for c in mats[1:]:
        f, arg = obj.join(c, f[:, None]).min(dim=0)
        choices.append(arg)
    bounds = [n]
    for arg in reversed(choices):
        bounds.append(int(arg[bounds[-1]]))
    bounds.append(0)
    return float(f[n]), bounds[::-1]


def _solve_v(mats: list[torch.Tensor], n: int, p: int, obj: _Objective) -> tuple[float, list[int]]:
    """V order: rank ``r`` owns stage ``r`` = ``[i, i')`` and stage ``2P-1-r`` = ``[j', j)`` around the middle."""
    inner = obj.leaf(mats[p - 1][:, :, None] + mats[p][None, :, :]).min(dim=1)  # innermost rank: [i, k) + [k, j)
    g = inner.values
    outer: list[tuple[torch.Tensor, torch.Tensor]] = []  # per rank r < P-1: best i', j' for each (i, j)
    for r in range(p - 2, -1, -1):
        a, b = mats[r], mats[2 * p - 1 - r]
        new = torch.full((n + 1, n + 1), _INF, dtype=torch.float64)
        arg_i = torch.zeros((n + 1, n + 1), dtype=torch.int64)
        arg_j = torch.zeros((n + 1, n + 1), dtype=torch.int64)
        for i in [0] if r == 0 else range(r, n - 2 * (p - 1 - r)):
            lo = i + 1  # the left stage [i, i') is not empty
            cols = slice(n, n + 1) if r == 0 else slice(0, n + 1)  # rank 0 only needs j = n
            val = obj.join(a[i, lo:, None, None] + b[None, :, cols], g[lo:, :, None])
            best, idx = val.reshape(-1, val.shape[-1]).min(dim=0)
            new[i, cols] = best
            arg_i[i, cols], arg_j[i, cols] = idx // (n + 1) + lo, idx % (n + 1)
        outer.append((arg_i, arg_j))
        g = new
    lefts, rights = [0], [n]
    for arg_i, arg_j in reversed(outer):
        i, j = lefts[-1], rights[-1]
        lefts.append(int(arg_i[i, j]))
        rights.append(int(arg_j[i, j]))
    mid = int(inner.indices[lefts[-1], rights[-1]])
    return float(g[0, n]), lefts + [mid] + rights[::-1]


def _solve_loop2(mats: list[torch.Tensor], n: int, p: int, obj: _Objective) -> tuple[float, list[int]]:
    """Interleaved, two stages per rank: chunk 0 = stages ``0..P-1``, chunk 1 = stages ``P..2P-1`` side by side."""
    best_val, best_bounds = _INF, [0, p] + list(range(n - p + 1, n + 1))  # placeholder when nothing is feasible
    for m in range(p, n - p + 1):
        if obj.cap is not None and obj.splits.get(m, _INF) > obj.cap:
            continue  # this chunk split cannot reach the minimax value
        xs, ys = m + 1, n - m + 1  # positions 0..m in chunk 0, m..n in chunk 1
        h = obj.leaf(mats[p - 1][:xs, m][:, None] + mats[2 * p - 1][m:, n][None, :])
        choices = []
        for r in range(p - 2, -1, -1):
            a = mats[r][:xs, :xs]
            b = mats[p + r][m:, m:]
            new = torch.full((xs, ys), _INF, dtype=torch.float64)
            arg = torch.zeros((xs, ys), dtype=torch.int64)
            for x in [0] if r == 0 else range(r, m - (p - 1 - r)):
                lo = x + 1
                rows = slice(0, 1) if r == 0 else slice(0, ys)  # rank 0 starts chunk 1 at m (y = 0)
                val = obj.join(a[x, None, lo:, None] + b[rows, None, :], h[None, lo:, :])
                best, idx = val.reshape(val.shape[0], -1).min(dim=1)
                new[x, rows] = best
                arg[x, rows] = (idx // ys + lo) * ys + idx % ys
            choices.append(arg)
            h = new
        value = float(h[0, 0])
        if obj.cap is None:
            obj.splits[m] = value
        if value < best_val:
            xs_path, ys_path = [0], [0]
            for arg in reversed(choices):
                idx = int(arg[xs_path[-1], ys_path[-1]])
                xs_path.append(idx // ys)
                ys_path.append(idx % ys)
            best_val = value
            best_bounds = xs_path + [m] + [m + y for y in ys_path[1:]] + [n]
    return best_val, best_bounds


def _solve(mats: list[torch.Tensor], n: int, p: int, v: int, schedule: str, obj: _Objective):
    if v == 1:
        return _solve_single(mats, n, obj)
    if schedule in ("zbv", "dualpipev") or p == 1:
        return _solve_v(mats, n, p, obj)
    return _solve_loop2(mats, n, p, obj)


def partition_layers(
    costs: Sequence[LayerCost | int],
    num_stages: int,
    *,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    max_bytes_per_rank: int | None = None,
    stages_per_rank: int | None = None,
    data_parallel_size: int = 1,
    bucket_bytes: int = BUCKET_BYTES,
    sharded: bool = False,
    ties: Sequence[tuple[int, int, LayerCost | int]] = (),
) -> Partition:
    """The contiguous split of ``costs`` into ``num_stages`` stages with the smallest largest per-rank peak.

    Args:
        costs: one entry per layer, in order: a :class:`LayerCost`, or an int (static bytes, no activations).
        num_stages: total stages ``N`` (``2 * ranks`` for ``zbv``/``dualpipev``/``interleaved_1f1b``).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zbv"`` or ``"dualpipev"``.
        microbatches: microbatches per step (default: ``num_stages``).
        max_bytes_per_rank: if given, raise ``ValueError`` (stating the best achievable peak) when no split
            fits every rank under it.
        stages_per_rank: stages per rank; only ``interleaved_1f1b`` allows a choice, and the exact search
            supports 2 there (use :func:`evaluate_partition` to score other splits).
        data_parallel_size: replicas of the pipeline (DDP); above 1, each rank's peak includes the buffer that
            averaging its gradients allocates before the optimizer step.
        bucket_bytes: the gradient all-reduce bucket (25 MiB, as
            :func:`~lightning_memkit.pipeline.gradients.average_gradients`).
        sharded: each layer is an FSDP2 unit sharded over the ``data_parallel_size`` replicas
            (``data_parallel="fsdp"``) instead of replicated (DDP, the default); see the module doc.
        ties: ``(i, j, cost)`` for layers ``i < j`` that share parameters, ``cost`` (a :class:`LayerCost` or
            static bytes) their bytes counted in both layers; a rank that always holds both pays them once
            (see the module doc).

    Example::

        >>> from lightning_memkit.pipeline import partition_layers
        >>> partition_layers([4, 1, 1, 1, 1, 4], 2, schedule="gpipe").sizes
        (3, 3)
    """
    layers, v, microbatches, inflight, ranks = _check_common(costs, num_stages, schedule, microbatches, stages_per_rank)
    check_int(max_bytes_per_rank, "max_bytes_per_rank", minimum=1, allow_none=True, owner="partition_layers")
    dp, bucket = _check_dp(data_parallel_size, bucket_bytes, "partition_layers", sharded)
    together = _together(_check_ties(ties, len(layers), "partition_layers"), len(layers), schedule, num_stages, v)
    n, p = len(layers), num_stages // v
    if v > 2:
        raise ValueError(
            f"stages_per_rank={v}: the exact memory partition for 'interleaved_1f1b' supports 2 stages per rank; "
            "pass explicit sizes (evaluate_partition) or use stages_per_rank=2"
        )
    mats = _matrices(layers, num_stages, inflight, microbatches, dp, bucket, sharded, together)
    sched = schedule.lower()
    minimax = _Objective()
    best, _ = _solve(mats, n, p, v, sched, minimax)
    _, bounds = _solve(mats, n, p, v, sched, _Objective(cap=best, splits=minimax.splits))
    result = _finish(layers, bounds, v, schedule, microbatches, inflight, ranks, "memory", dp, bucket, sharded,
                     together)
    value = result.max_peak_bytes
    assert value == int(best), (value, best)
    if max_bytes_per_rank is not None and value > max_bytes_per_rank:
        worst = result.predicted_peak_bytes.index(value)
        raise ValueError(
            f"max_bytes_per_rank={max_bytes_per_rank} cannot be met: the best achievable split {list(result.sizes)} "
            f"still needs {value} bytes on rank {worst} ({value / 2**20:.2f} MiB); raise the cap, add ranks or "
            "microbatch differently"
        )
    return result


# -- baselines --------------------------------------------------------------------------------------------
def uniform_partition(
    costs: Sequence[LayerCost | int],
    num_stages: int,
    *,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    stages_per_rank: int | None = None,
    data_parallel_size: int = 1,
    bucket_bytes: int = BUCKET_BYTES,
    sharded: bool = False,
    ties: Sequence[tuple[int, int, LayerCost | int]] = (),
) -> Partition:
    """Equal layer counts per stage (the first ``L mod N`` stages get one more), scored with the memory model."""
    layers, *_ = _check_common(costs, num_stages, schedule, microbatches, stages_per_rank, owner="uniform_partition")
    n = len(layers)
    sizes = [n // num_stages + (1 if s < n % num_stages else 0) for s in range(num_stages)]
    return evaluate_partition(
        layers, sizes, schedule=schedule, microbatches=microbatches, stages_per_rank=stages_per_rank, method="uniform",
        data_parallel_size=data_parallel_size, bucket_bytes=bucket_bytes, sharded=sharded, ties=ties,
    )


def parameter_balanced_partition(
    costs: Sequence[LayerCost | int],
    num_stages: int,
    *,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    stages_per_rank: int | None = None,
    data_parallel_size: int = 1,
    bucket_bytes: int = BUCKET_BYTES,
    sharded: bool = False,
    ties: Sequence[tuple[int, int, LayerCost | int]] = (),
) -> Partition:
    """The split with the smallest largest per-*stage* trainable-parameter bytes, scored with the memory model.

    Trainable bytes are ``grad_bytes`` (``param_bytes`` when no layer has gradients, or for int costs).
    """
    layers, *_ = _check_common(
        costs, num_stages, schedule, microbatches, stages_per_rank, owner="parameter_balanced_partition"
    )
    weights = [c.grad_bytes for c in layers]
    if not any(weights):
        weights = [c.param_bytes for c in layers]
    pre = _prefix(weights)
    n = len(layers)
    a = torch.arange(n + 1)[:, None]
    b = torch.arange(n + 1)[None, :]
    mat = torch.where(a < b, (pre[b] - pre[a]).double(), torch.full((n + 1, n + 1), _INF, dtype=torch.float64))
    best, _ = _solve_single([mat] * num_stages, n, _Objective())
    _, bounds = _solve_single([mat] * num_stages, n, _Objective(cap=best))
    sizes = [bounds[s + 1] - bounds[s] for s in range(num_stages)]
    return evaluate_partition(
        layers, sizes, schedule=schedule, microbatches=microbatches, stages_per_rank=stages_per_rank,
        method="parameters", data_parallel_size=data_parallel_size, bucket_bytes=bucket_bytes, sharded=sharded,
        ties=ties,
    )
