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
first ``k`` at which the greedy prefix is under budget is the minimum (``tests/memory/test_checkpoint_plan.py``
checks this against every subset).

Mixed plans (:func:`plan_recompute`): each layer is left alone, recomputed selectively (its matmul and
attention outputs kept, the rest rebuilt: a smaller saving ``s_i^sel`` for a small time cost ``c_i^sel``)
or recomputed in full (``s_i^full`` for ``c_i^full``). The overhead is that of the most expensive mode
used. Among the assignments whose predicted peak is within the budget, the one with the least predicted
recompute time is exact by dynamic programming over the layers (a Pareto front of saved bytes against
time, the saving capped at what the budget needs).

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

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memkit.memory.activation_recompute import SAVED_OPS
from lightning_memkit.validation import check_int, check_number

__all__ = [
    "CheckpointPlan",
    "plan_checkpointing",
    "plan_recompute",
    "layer_savings",
    "predicted_peak",
    "mixed_peak",
    "calibrate",
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
) -> int:
    """The predicted peak of a mixed plan: baseline minus each layer's saving in its mode, plus the largest
    overhead among the modes used (none when nothing is recomputed)."""
    if not modes:
        return baseline_peak
    overhead = recompute_overhead or {}
    return (baseline_peak - sum(savings[name][mode] for name, mode in modes.items())
            + max(overhead.get(mode, 0) for mode in set(modes.values())))


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


def _front(states: list[tuple[int, float, tuple]], need: int) -> list[tuple[int, float, tuple]]:
    """The Pareto front of (saved, cost, assignment): more saved (capped at ``need``) for less time.

    Ties keep the assignment that recomputes earlier layers more (lexicographically largest levels).
    """
    states = [(min(saved, need), cost, levels) for saved, cost, levels in states]
    states.sort(key=lambda st: (-st[0], st[1], tuple(-lv for lv in st[2])))
    front, best = [], math.inf
    for st in states:
        if st[1] < best:
            front.append(st)
            best = st[1]
    return front


def _cheapest(savings: dict, costs: dict, allowed: tuple[str, ...], need: int) -> tuple[float, tuple] | None:
    """Least total cost of an assignment (0 none, 1 selective, 2 full) saving at least ``need`` bytes."""
    states: list[tuple[int, float, tuple]] = [(0, 0.0, ())]
    for name in savings:
        options = [(0, 0.0, 0)] + [(savings[name][m], costs[name][m], 1 + MODES.index(m))
                                    for m in allowed if savings[name][m] > 0]
        states = _front([(s + ds, c + dc, lv + (lvl,)) for s, c, lv in states for ds, dc, lvl in options], need)
    done = [st for st in states if st[0] >= need]
    return (done[0][1], done[0][2]) if done else None


def _best_mixed_peak(savings: dict, baseline_peak: int, overhead: Mapping[str, int]) -> int:
    """The lowest predicted peak of any assignment: each layer in its largest-saving allowed mode."""
    best = baseline_peak
    for allowed in (("selective",), ("full",), MODES):
        saved = sum(max(0, *(row[m] for m in allowed)) for row in savings.values())
        if saved > 0:
            best = min(best, baseline_peak - saved + max(overhead[m] for m in allowed))
    return best


def plan_recompute(
    savings: Mapping[str, Mapping[str, int]],
    baseline_peak: int,
    budget_bytes: int,
    costs: Mapping[str, Mapping[str, float]] | None = None,
    recompute_overhead: Mapping[str, int] | None = None,
) -> CheckpointPlan:
    """Per layer none, selective or full recompute: the least predicted recompute time within ``budget_bytes``.

    Args:
        savings: layer -> ``{"selective": bytes, "full": bytes}`` each mode saves (model order is kept).
        baseline_peak: the measured peak of the step with nothing recomputed.
        budget_bytes: the peak to reach.
        costs: layer -> ``{"selective": t, "full": t}``, the time each mode adds (default
            :data:`DEFAULT_COSTS` for every layer).
        recompute_overhead: ``{"selective": bytes, "full": bytes}``, the transient each mode adds when used.

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
    best = None
    for allowed in (("selective",), ("full",), MODES):
        need = baseline_peak + max(overhead[m] for m in allowed) - budget_bytes
        found = _cheapest(rows, cost_rows, allowed, need)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    if best is None:
        raise ValueError(
            f"budget_bytes={budget_bytes} cannot be reached: the best achievable peak is "
            f"{_best_mixed_peak(rows, baseline_peak, overhead)} "
            f"bytes (baseline {baseline_peak} bytes, every candidate layer recomputed); raise budget_bytes, widen the "
            "policy or lower the batch size"
        )
    modes = {n: MODES[lv - 1] for n, lv in zip(names, best[1]) if lv}
    plan.layers = list(modes)
    plan.selective = [n for n, m in modes.items() if m == "selective"]
    plan.predicted_cost = best[0]
    plan.predicted_peak = mixed_peak(rows, baseline_peak, modes, overhead)
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
    scale = {}
    for mode in MODES:  # the model's profiled reduction: the savings minus the overhead (clipped at 0 when negative)
        cut = sum(row[mode] for row in savings.values() if row[mode] > 0) - overhead.get(mode, 0)
        scale[mode] = max(0.0, (measured["none"] - measured[mode]) / cut) if cut > 0 else 0.0
    fitted = {name: {m: round(row[m] * scale[m]) for m in MODES} for name, row in savings.items()}
    return measured["none"], fitted, {m: round(overhead.get(m, 0) * scale[m]) for m in MODES}


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
