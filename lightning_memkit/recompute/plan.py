"""Which layers to recompute so that one training step fits a memory budget, with as few as possible.

The model: a step without recomputation peaks at ``baseline_peak`` bytes. Recomputing layer ``i``
(activation checkpointing) drops what it saves for backward except its inputs, a saving ``s_i``
measured by :func:`lightning_memkit.memory.profile_saved_tensors`; recomputation itself costs a fixed
transient ``recompute_overhead`` (the one layer whose activations are rebuilt at a time during backward,
measured once with every candidate recomputed). The predicted peak of a set ``S`` is then::

    peak(S) = baseline_peak                                    if S is empty
    peak(S) = baseline_peak - sum(s_i for i in S) + recompute_overhead   otherwise

With independent savings the fewest layers that reach a budget are the largest savings first:
for any ``k`` the ``k`` largest savings give the lowest ``peak`` over all sets of ``k`` layers, so the
first ``k`` at which the greedy prefix is under budget is the minimum (``tests/recompute/test_plan.py``
checks this against every subset).

Mixed plans (:func:`plan_recompute`): each layer is left alone, recomputed selectively (its matmul and
attention outputs kept, the rest rebuilt: a smaller saving ``s_i^sel`` for a small time cost ``c_i^sel``)
or recomputed in full (``s_i^full`` for ``c_i^full``), ``s_i`` being the saving of its mode. A full
recompute of layer ``i`` runs in backward after the later layers' backward has freed all they saved
(``a_j``, ``activation_bytes``), so with ``i*`` the last (in forward order) layer recomputed in full::

    peak = max(baseline_peak - sum(s_i) + overhead_sel,                      (overhead_sel if any selective)
               baseline_peak - sum(s_i, i <= i*) - sum(a_j, j > i*) + overhead_full)   (if any full)

(every layer in full gives ``baseline_peak - sum(s_i) + overhead_full``, the measured all-full peak).
Without ``activation_bytes`` nothing later is counted as freed: the full term is
``baseline_peak - sum(s_i) + overhead_full``. Among the assignments whose predicted peak is within the
budget, the one with the least predicted recompute time is exact: for each ``i*`` a dynamic program over
the layers before it and one over those after it (Pareto fronts of saved bytes against time, the saving
capped at what the budget needs), joined on the two constraints.

Example::

    >>> from lightning_memkit.memory import plan_checkpointing
    >>> plan = plan_checkpointing({"blocks.0": 30, "blocks.1": 50, "blocks.2": 40}, baseline_peak=200,
    ...                           budget_bytes=120)
    >>> plan.layers, plan.predicted_peak
    (['blocks.1', 'blocks.2'], 110)
    >>> savings = {"b0": {"selective": 20, "full": 50}, "b1": {"selective": 20, "full": 50}}
    >>> costs = {"b0": {"selective": 1.0, "full": 3.0}, "b1": {"selective": 1.0, "full": 3.0}}
    >>> plan_recompute(savings, baseline_peak=200, budget_bytes=165, costs=costs).modes
    {'b0': 'selective', 'b1': 'selective'}
    >>> plan_recompute(savings, baseline_peak=200, budget_bytes=140, costs=costs).modes
    {'b0': 'full', 'b1': 'selective'}
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memkit.common.validation import check_int, check_number
from lightning_memkit.recompute.activation_recompute import SAVED_OPS

__all__ = [
    "CheckpointPlan",
    "plan_checkpointing",
    "plan_recompute",
    "layer_savings",
    "predicted_peak",
    "mixed_peak",
    "calibrate",
    "calibrate_activations",
    "RecomputeCostMeter",
    "DEFAULT_COSTS",
]

MODES = ("selective", "full")
DEFAULT_COSTS = {"selective": 1.0, "full": 3.0}  # relative recompute time when none is measured


@dataclass
class CheckpointPlan:
    """The layers to recompute (in model order) and the peak the model predicts for them, in bytes."""

    layers: list[str]
    predicted_peak: int
    baseline_peak: int
    budget_bytes: int
    savings: dict[str, int] = field(default_factory=dict)
    recompute_overhead: int = 0
    ranked: list[str] = field(default_factory=list)  # candidates with a positive saving, largest first
    selective: list[str] = field(default_factory=list)  # the layers (of ``layers``) recomputed selectively
    predicted_cost: float = 0.0  # mixed plans: predicted recompute time (units of ``costs``)
    mode_savings: dict[str, dict[str, int]] = field(default_factory=dict)  # mixed plans: layer -> mode -> bytes

    @property
    def modes(self) -> dict[str, str]:
        """Layer -> ``"selective"`` or ``"full"`` for each recomputed layer, in model order."""
        return {name: "selective" if name in self.selective else "full" for name in self.layers}

    @property
    def saved_bytes(self) -> int:
        """Predicted activation bytes the recomputed layers no longer keep, each in its mode."""
        if self.mode_savings:
            return sum(self.mode_savings[name][mode] for name, mode in self.modes.items())
        return sum(self.savings[name] for name in self.layers)

    def first(self, k: int) -> list[str]:
        """The ``k`` largest-saving layers, in model order (what the plan picks when ``k`` layers are needed)."""
        order = {name: i for i, name in enumerate(self.savings)}
        return sorted(self.ranked[:k], key=order.__getitem__)

    @property
    def best_peak(self) -> int:
        """The predicted peak with every layer that saves anything recomputed."""
        return best_peak(self.savings, self.baseline_peak, self.recompute_overhead)

    def __str__(self) -> str:
        names = ", ".join(f"{n} ({m})" if self.selective else n for n, m in self.modes.items()) or "none"
        return (
            f"recompute {len(self.layers)} of {len(self.savings)} layers ({names}); predicted peak "
            f"{self.predicted_peak} bytes vs budget {self.budget_bytes} (baseline {self.baseline_peak})"
        )


_OWNER = "plan_checkpointing"


def predicted_peak(
    savings: Mapping[str, int], baseline_peak: int, chosen: Sequence[str], recompute_overhead: int = 0
) -> int:
    """``peak(S)`` of the module docstring for the layer names in ``chosen``."""
    if not chosen:
        return baseline_peak
    return baseline_peak - sum(savings[name] for name in chosen) + recompute_overhead


def best_peak(savings: Mapping[str, int], baseline_peak: int, recompute_overhead: int = 0) -> int:
    """The lowest predicted peak reachable: every layer with a positive saving recomputed (or none)."""
    useful = [n for n, s in savings.items() if s > 0]
    return min(baseline_peak, predicted_peak(savings, baseline_peak, useful, recompute_overhead))


def plan_checkpointing(
    savings: Mapping[str, int],
    baseline_peak: int,
    budget_bytes: int,
    recompute_overhead: int = 0,
) -> CheckpointPlan:
    """The fewest layers whose recomputation brings the predicted step peak to ``budget_bytes`` or below.

    Args:
        savings: layer name -> bytes its recomputation saves (model order is kept in the result).
        baseline_peak: the measured peak of the step with nothing recomputed.
        budget_bytes: the peak to reach.
        recompute_overhead: transient bytes (>= 0) added by recomputation whenever any layer is recomputed.

    Among the sets of minimum size it returns the one with the lowest predicted peak (ties: earlier
    layers first). Raises ``ValueError`` stating the best achievable peak when no set reaches the budget.
    """
    if not isinstance(savings, Mapping):
        raise TypeError(f"savings must be a mapping of layer name -> bytes, got {type(savings).__name__}")
    for name, s in savings.items():
        check_int(s, f"savings[{name!r}]", owner=_OWNER)  # bytes
    check_int(baseline_peak, "baseline_peak", minimum=0, owner=_OWNER)
    check_int(budget_bytes, "budget_bytes", minimum=0, owner=_OWNER)
    check_int(recompute_overhead, "recompute_overhead", minimum=0, owner=_OWNER)
    order = {name: i for i, name in enumerate(savings)}
    ranked = sorted((n for n in savings if savings[n] > 0), key=lambda n: (-savings[n], order[n]))
    plan = CheckpointPlan([], baseline_peak, baseline_peak, budget_bytes, dict(savings), recompute_overhead, ranked)
    if baseline_peak <= budget_bytes:
        return plan
    for k in range(1, len(ranked) + 1):
        chosen = ranked[:k]
        peak = predicted_peak(savings, baseline_peak, chosen, recompute_overhead)
        if peak <= budget_bytes:
            plan.layers = plan.first(k)
            plan.predicted_peak = peak
            return plan
    best = best_peak(savings, baseline_peak, recompute_overhead)
    raise ValueError(
        f"budget_bytes={budget_bytes} cannot be reached: the best achievable peak is {best} bytes "
        f"(baseline {baseline_peak} bytes, all {len(ranked)} candidate layers recomputed"
        f"{f', recompute overhead {recompute_overhead} bytes' if recompute_overhead else ''}); "
        "raise budget_bytes, widen the policy or lower the batch size"
    )


def layer_savings(
    activation_bytes: Mapping[str, int], input_bytes: Mapping[str, int]
) -> dict[str, int]:
    """Per-layer saving of recomputation: activation bytes saved inside the layer minus its inputs.

    A recomputed layer still keeps its inputs (to run again in backward); everything else it saved for
    backward is dropped. Negative differences (inputs larger than what was saved) count as 0.
    """
    return {name: max(0, int(a) - int(input_bytes.get(name, 0))) for name, a in activation_bytes.items()}


def mixed_peak(
    savings: Mapping[str, Mapping[str, int]],
    baseline_peak: int,
    modes: Mapping[str, str],
    recompute_overhead: Mapping[str, int] | None = None,
    activation_bytes: Mapping[str, int] | None = None,
) -> int:
    """The predicted peak of a mixed plan (module docstring): the larger of the selective term (baseline minus
    every saving, plus the selective overhead if a layer is selective) and the full-recompute term.

    ``savings`` gives the model order; ``activation_bytes`` (layer -> bytes it saves with nothing recomputed)
    is what a later layer frees before a full recompute (``None``: nothing counted as freed)."""
    if not modes:
        return baseline_peak
    overhead = recompute_overhead or {}
    peak = baseline_peak - sum(savings[name][mode] for name, mode in modes.items())
    if "selective" in modes.values():
        peak += overhead.get("selective", 0)
    if "full" not in modes.values():
        return peak
    names = list(savings)
    last = max(i for i, name in enumerate(names) if modes.get(name) == "full")
    kept = names if activation_bytes is None else names[:last + 1]  # later layers free all they saved
    full = baseline_peak - sum(savings[name][modes[name]] for name in kept if name in modes)
    if activation_bytes is not None:
        full -= sum(activation_bytes[name] for name in names[last + 1:])
    return max(peak, full + overhead.get("full", 0))


def _check_per_mode(table: object, what: str, names: Sequence[str] | None, number: bool) -> dict[str, dict]:
    """``name -> {"selective": v, "full": v}`` validated (ints >= 0 or finite numbers >= 0)."""
    if not isinstance(table, Mapping):
        raise TypeError(f"plan_recompute({what}=...) must be a mapping of layer name -> {{mode: value}}, "
                        f"got {type(table).__name__}")
    out = {}
    for name, row in table.items():
        if not isinstance(row, Mapping) or set(row) != set(MODES):
            raise ValueError(f"plan_recompute({what}[{name!r}]={row!r}): must map exactly 'selective' and 'full'")
        label = f"{what}[{name!r}]"
        out[name] = {mode: check_number(row[mode], f"{label}[{mode!r}]", minimum=0, owner="plan_recompute")
                     if number else check_int(row[mode], f"{label}[{mode!r}]", owner="plan_recompute")
                     for mode in MODES}
    if names is not None and list(out) != list(names):
        raise ValueError(f"plan_recompute({what}=...) must name the same layers as savings, in the same order")
    return out


def _check_activations(table: object, names: Sequence[str]) -> dict[str, int] | None:
    """``activation_bytes`` validated: ``None`` or layer -> int >= 0 for exactly the layers of ``savings``."""
    if table is None:
        return None
    if not isinstance(table, Mapping):
        raise TypeError(f"plan_recompute(activation_bytes=...) must be a mapping of layer name -> bytes, "
                        f"got {type(table).__name__}")
    if list(table) != list(names):
        raise ValueError("plan_recompute(activation_bytes=...) must name the same layers as savings, in the same order")
    return {name: check_int(v, f"activation_bytes[{name!r}]", minimum=0, owner="plan_recompute")
            for name, v in table.items()}


def _front(states: list[tuple[int, float, tuple]], need: int) -> list[tuple[int, float, tuple]]:
    """The Pareto front of (saved, cost, assignment): more saved (capped at ``need``) for less time.

    Sorted by saved bytes, most first (so by cost, most first). Ties keep the assignment that recomputes
    earlier layers more (lexicographically largest levels).
    """
    states = [(min(saved, need), cost, levels) for saved, cost, levels in states]
    states.sort(key=lambda st: (-st[0], st[1], tuple(-lv for lv in st[2])))
    front, best = [], math.inf
    for st in states:
        if st[1] < best:
            front.append(st)
            best = st[1]
    return front


_States = list[tuple[int, float, tuple]]


def _sweep(savings: dict, costs: dict, names: Sequence[str], allowed: tuple[str, ...], need: int) -> _States:
    """The front of the assignments (0 none, 1 selective, 2 full) of the layers ``names``."""
    states: _States = [(0, 0.0, ())]
    for name in names:
        options = [(0, 0.0, 0)] + [(savings[name][m], costs[name][m], 1 + MODES.index(m))
                                    for m in allowed if savings[name][m] > 0]
        states = _front([(s + ds, c + dc, lv + (lvl,)) for s, c, lv in states for ds, dc, lvl in options], need)
    return states


def _key(found: tuple[float, tuple]) -> tuple:
    """Order of candidate plans: least cost, then the one recomputing earlier layers more."""
    return found[0], tuple(-lv for lv in found[1])


def _join(head: _States, tail: _States, need_total: int, need_head: int) -> tuple[float, tuple] | None:
    """Cheapest ``head + tail`` with head savings >= ``need_head`` and head + tail savings >= ``need_total``."""
    tail_saved = [-st[0] for st in tail]  # ascending; cost descends along the front
    best = None
    for saved, cost, levels in head:
        if saved < need_head:
            continue
        k = bisect.bisect_right(tail_saved, saved - need_total) - 1  # the last (cheapest) with enough saved
        if k >= 0:
            found = (cost + tail[k][1], levels + tail[k][2])
            best = found if best is None or _key(found) < _key(best) else best
    return best


def _cheapest(savings: dict, costs: dict, allowed: tuple[str, ...], need: int) -> tuple[float, tuple] | None:
    """Least total cost of an assignment saving at least ``need`` bytes (no full-recompute term)."""
    done = [st for st in _sweep(savings, costs, list(savings), allowed, need) if st[0] >= need]
    return (done[0][1], done[0][2]) if done else None


def _cheapest_with_full(savings: dict, costs: dict, allowed: tuple[str, ...], need: int,
                        full_need: Callable[[int], tuple[int, int]]) -> tuple[float, tuple] | None:
    """Least cost over the assignments with a layer in full: for each last full layer ``i``, the cheapest
    head (layers up to ``i``, ``i`` in full) and tail (later layers, not full) meeting ``full_need(i)``:
    ``(total saving needed, head saving needed)``."""
    names, rest = list(savings), tuple(m for m in allowed if m != "full")
    best = None
    for i, name in enumerate(names):
        if savings[name]["full"] <= 0:
            continue
        need_total, need_head = full_need(i)
        cap = max(need_total, need_head)
        head = [(s + savings[name]["full"], c + costs[name]["full"], lv + (2,))
                for s, c, lv in _sweep(savings, costs, names[:i], allowed, cap)]
        found = _join(_front(head, cap), _sweep(savings, costs, names[i + 1:], rest, need_total),
                      need_total, need_head)
        if found is not None and (best is None or _key(found) < _key(best)):
            best = found
    return best


def _full_need(baseline_peak: int, budget_bytes: int, overhead: int, need: int,
               acts: dict[str, int] | None) -> Callable[[int], tuple[int, int]]:
    """``i -> (total saving needed, saving needed up to i)`` for the last full layer ``i`` (module docstring)."""
    over = baseline_peak + overhead - budget_bytes
    if acts is None:
        return lambda i: (max(need, over), 0)
    freed = list(itertools.accumulate(reversed(list(acts.values())), initial=0))[::-1]  # freed[i]: layers >= i
    return lambda i: (need, over - freed[i + 1])


def _search(savings: dict, costs: dict, baseline_peak: int, budget_bytes: int, overhead: Mapping[str, int],
            acts: dict[str, int] | None) -> tuple[float, tuple] | None:
    """The cheapest assignment whose predicted peak is within the budget, over each set of modes allowed."""
    best = None
    for allowed in (("selective",), ("full",), MODES):
        need = baseline_peak + (overhead["selective"] if "selective" in allowed else 0) - budget_bytes
        if "full" in allowed:
            full_need = _full_need(baseline_peak, budget_bytes, overhead["full"], need, acts)
            found = _cheapest_with_full(savings, costs, allowed, need, full_need)
        else:
            found = _cheapest(savings, costs, allowed, need)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    return best


def _greedy_modes(savings: dict, allowed: tuple[str, ...], last: int) -> dict[str, str]:
    """Layer ``last`` in full, the others in their largest-saving allowed mode (none in full after ``last``)."""
    modes = {}
    for i, name in enumerate(savings):
        pool = ("full",) if i == last else allowed if i < last else tuple(m for m in allowed if m != "full")
        options = [m for m in pool if savings[name][m] > 0]
        if options:
            modes[name] = max(options, key=savings[name].__getitem__)
    return modes


def _best_mixed_peak(savings: dict, baseline_peak: int, overhead: Mapping[str, int],
                     acts: dict[str, int] | None = None) -> int:
    """The lowest predicted peak of any assignment: for each set of modes and last full layer, the others in
    their largest-saving allowed mode (both terms of the peak only fall as savings grow)."""
    best = baseline_peak
    for allowed in (("selective",), ("full",), MODES):
        lasts = [i for i, row in enumerate(savings.values()) if row["full"] > 0] if "full" in allowed else [-1]
        for last in lasts:
            modes = _greedy_modes(savings, allowed, last if last >= 0 else len(savings))
            best = min(best, mixed_peak(savings, baseline_peak, modes, overhead, acts))
    return best


def plan_recompute(
    savings: Mapping[str, Mapping[str, int]],
    baseline_peak: int,
    budget_bytes: int,
    costs: Mapping[str, Mapping[str, float]] | None = None,
    recompute_overhead: Mapping[str, int] | None = None,
    activation_bytes: Mapping[str, int] | None = None,
) -> CheckpointPlan:
    """Per layer none, selective or full recompute: the least predicted recompute time within ``budget_bytes``.

    Args:
        savings: layer -> ``{"selective": bytes, "full": bytes}`` each mode saves (model order is kept).
        baseline_peak: the measured peak of the step with nothing recomputed.
        budget_bytes: the peak to reach.
        costs: layer -> ``{"selective": t, "full": t}``, the time each mode adds (default
            :data:`DEFAULT_COSTS` for every layer).
        recompute_overhead: ``{"selective": bytes, "full": bytes}``, the transient each mode adds when used
            (``"full"``: measured with every layer in full).
        activation_bytes: layer -> bytes it saves for backward with nothing recomputed (inputs included), freed
            by its backward before any earlier layer is recomputed in full (``None``: nothing counted as freed;
            the full overhead then adds to every saving). See :func:`mixed_peak`.

    The result's ``layers`` are the recomputed layers, ``selective`` those of them recomputed selectively,
    ``modes`` both as a mapping. Raises ``ValueError`` stating the best achievable peak when no assignment
    reaches the budget.
    """
    rows = _check_per_mode(savings, "savings", None, number=False)
    names = list(rows)
    cost_rows = _check_per_mode(costs if costs is not None else dict.fromkeys(names, DEFAULT_COSTS), "costs",
                                names, number=True)
    check_int(baseline_peak, "baseline_peak", minimum=0, owner="plan_recompute")
    check_int(budget_bytes, "budget_bytes", minimum=0, owner="plan_recompute")
    overhead = {m: check_int((recompute_overhead or {}).get(m, 0), f"recompute_overhead[{m!r}]", minimum=0,
                             owner="plan_recompute") for m in MODES}
    plan = CheckpointPlan([], baseline_peak, baseline_peak, budget_bytes, {n: rows[n]["full"] for n in names},
                          mode_savings=rows)
    if baseline_peak <= budget_bytes:
        return plan
    acts = _check_activations(activation_bytes, names)
    best = _search(rows, cost_rows, baseline_peak, budget_bytes, overhead, acts)
    if best is None:
        raise ValueError(
            f"budget_bytes={budget_bytes} cannot be reached: the best achievable peak is "
            f"{_best_mixed_peak(rows, baseline_peak, overhead, acts)} bytes (baseline {baseline_peak} bytes, "
            "best none/selective/full assignment of the candidate layers); raise budget_bytes, widen the policy or "
            "lower the batch size"
        )
    modes = {n: MODES[lv - 1] for n, lv in zip(names, best[1]) if lv}
    plan.layers = list(modes)
    plan.selective = [n for n, m in modes.items() if m == "selective"]
    plan.predicted_cost = best[0]
    plan.predicted_peak = mixed_peak(rows, baseline_peak, modes, overhead, acts)
    return plan


def calibrate(
    savings: Mapping[str, Mapping[str, int]],
    overhead: Mapping[str, int],
    measured: Mapping[str, int],
) -> tuple[int, dict[str, dict[str, int]], dict[str, int]]:
    """Fit profiled savings to peaks measured another way (a compiled step): ``(baseline, savings, overhead)``.

    ``measured`` maps ``"none"``, ``"selective"`` and ``"full"`` (every layer in that mode) to a peak. Each
    mode's savings and overhead are scaled by the ratio of its measured reduction to the reduction the model
    predicts for it (its savings minus its overhead), so the model predicts each measured all-layer peak
    exactly and interpolates between.

    Example::

        >>> calibrate({"a": {"selective": 10, "full": 40}}, {"selective": 0, "full": 0},
        ...           {"none": 80, "selective": 75, "full": 40})
        (80, {'a': {'selective': 5, 'full': 40}}, {'selective': 0, 'full': 0})
    """
    scale = _scales(savings, overhead, measured)
    fitted = {name: {m: round(row[m] * scale[m]) for m in MODES} for name, row in savings.items()}
    return measured["none"], fitted, {m: round(overhead.get(m, 0) * scale[m]) for m in MODES}


def _scales(savings: Mapping[str, Mapping[str, int]], overhead: Mapping[str, int],
            measured: Mapping[str, int]) -> dict[str, float]:
    """Per mode: measured reduction over the profiled one (its savings minus its overhead; 0 when not positive)."""
    scale = {}
    for mode in MODES:
        cut = sum(row[mode] for row in savings.values() if row[mode] > 0) - overhead.get(mode, 0)
        scale[mode] = max(0.0, (measured["none"] - measured[mode]) / cut) if cut > 0 else 0.0
    return scale


def calibrate_activations(
    activation_bytes: Mapping[str, int],
    savings: Mapping[str, Mapping[str, int]],
    overhead: Mapping[str, int],
    measured: Mapping[str, int],
) -> dict[str, int]:
    """Per-layer activation bytes scaled as :func:`calibrate` scales the full-recompute savings (same arguments).

    With every layer in full the fitted model then still predicts the measured all-full peak.

    Example::

        >>> calibrate_activations({"a": 50}, {"a": {"selective": 10, "full": 40}}, {"selective": 0, "full": 0},
        ...                       {"none": 80, "selective": 75, "full": 60})
        {'a': 25}
    """
    scale = _scales(savings, overhead, measured)["full"]
    return {name: round(a * scale) for name, a in activation_bytes.items()}


class RecomputeCostMeter(TorchDispatchMode):
    """Times the forward ops of each given layer: what recomputing it fully or selectively would cost.

    Enter it around one forward (it registers forward hooks on the layers and removes them on exit); then
    :attr:`costs` maps each layer to ``{"full": seconds of all its ops, "selective": seconds of its ops
    outside SAVED_OPS}``, the time each mode repeats in backward. On CUDA each op is synchronized (slow,
    for one planning forward only). Enter it before other dispatch modes so it times the bare ops.

    Example::

        >>> net = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        >>> with RecomputeCostMeter([("net", net)]) as meter:
        ...     _ = net(torch.randn(4, 8))
        >>> 0 < meter.costs["net"]["selective"] < meter.costs["net"]["full"]
        True
    """

    def __init__(self, layers: Sequence[tuple[str, nn.Module]]):
        super().__init__()
        self._layers = list(layers)
        self.costs: dict[str, dict[str, float]] = {name: dict.fromkeys(MODES, 0.0) for name, _ in self._layers}
        self._current: list[str] = []
        self._hooks: list[Any] = []

    def __enter__(self) -> RecomputeCostMeter:
        for name, module in self._layers:
            self._hooks.append(module.register_forward_pre_hook(self._enter_layer(name)))
            self._hooks.append(module.register_forward_hook(self._leave_layer, always_call=True))
        return super().__enter__()

    def _enter_layer(self, name: str) -> Any:
        def hook(*_args: Any) -> None:
            self._current.append(name)

        return hook

    def _leave_layer(self, *_args: Any) -> None:
        self._current.pop()

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._current:
            return func(*args, **kwargs)
        cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        spent = time.perf_counter() - start
        row = self.costs[self._current[-1]]
        row["full"] += spent
        if func not in SAVED_OPS:
            row["selective"] += spent
        return out
