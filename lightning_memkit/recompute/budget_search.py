"""Activation checkpointing within a byte budget, checked by measurement: the layers (and modes) the profile-based
planners of :mod:`~lightning_memkit.recompute.plan` pick, kept only where a measured step fits.

``peak(modes)`` is the caller's measurement of one step with ``modes`` (layer name -> ``"full"`` /
``"selective"``) applied; ``measured`` holds the peaks already measured with nothing (``"none"``), every layer
selectively and every layer fully recomputed. :func:`measured_full_plan` keeps the shortest prefix of the
largest-saving-first order whose measured peak fits; :func:`measured_mixed_plan` re-plans for a target lowered by
a measured overshoot or raised by a measured slack, and keeps the cheapest measured plan that fits.

Example (a pretend step whose peak is 100 bytes less per recomputed layer)::

    >>> from lightning_memkit.recompute.budget_search import measured_full_plan
    >>> savings = {"a": 100, "b": 100, "c": 100}
    >>> plan, got = measured_full_plan(savings, 500, 0, {"none": 500, "full": 200},
    ...                                lambda modes: 500 - 100 * len(modes), budget=350)
    >>> len(plan.layers), got
    (2, 300)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lightning_memkit.recompute.plan import (
    CheckpointPlan,
    layer_savings,
    plan_checkpointing,
    plan_recompute,
    predicted_peak,
)

__all__ = ["MAX_PROBES", "measured_full_plan", "measured_mixed_plan", "mode_savings"]

MAX_PROBES = 4  # mixed plans: measured plans tried (the cheapest that fits is kept)
Peak = Callable[[dict[str, str]], int]


def mode_savings(acts: dict[str, int], inputs: dict[str, int], selective_kept: dict[str, int] | None) -> dict:
    """Layer -> ``{"selective": bytes, "full": bytes}`` saved by each mode, from the saved-tensor profiles.

    Full recompute keeps only the inputs; selective also keeps what its run left stashed in the layer (the
    matmul and attention outputs), never more than without recompute, never less than full.
    """
    full = layer_savings(acts, inputs)
    out = {}
    for name, saving in full.items():
        rest = acts[name] - inputs.get(name, 0) - selective_kept[name] if selective_kept is not None else 0
        out[name] = {"selective": min(saving, max(0, rest)), "full": saving}
    return out


def _unreachable(budget: int, best: int, baseline: int) -> ValueError:
    return ValueError(f"budget_bytes={budget} cannot be reached: the best measured peak is {best} bytes (baseline "
                      f"{baseline} bytes); raise budget_bytes, widen the policy or lower the batch size")


def measured_full_plan(savings: dict[str, int], baseline: int, overhead: int, measured: dict[str, int], peak: Peak,
                       budget: int) -> tuple[CheckpointPlan, int]:
    """The fewest full-recompute layers: greedy by saving, then the shortest measured prefix within ``budget``."""
    plan = plan_checkpointing(savings, baseline, budget, recompute_overhead=overhead)
    by_k = {0: measured["none"], len(plan.ranked): measured["full"]}

    def peak_of(k: int) -> int:
        if k not in by_k:
            by_k[k] = peak(dict.fromkeys(plan.first(k), "full"))
        return by_k[k]

    k = len(plan.layers)
    while k > 0 and peak_of(k - 1) <= budget:
        k -= 1
    while peak_of(k) > budget and k < len(plan.ranked):
        k += 1
    if peak_of(k) > budget:
        raise _unreachable(budget, min(by_k.values()), baseline)
    plan.layers = plan.first(k)
    plan.predicted_peak = predicted_peak(savings, baseline, plan.layers, overhead)
    return plan, peak_of(k)


def measured_mixed_plan(savings: dict, baseline: int, overhead: dict, costs: dict, measured: dict[str, int],
                        peak: Peak, budget: int, candidates: Sequence[str],
                        acts: dict[str, int] | None = None) -> tuple[CheckpointPlan, int]:
    """The cheapest none/selective/full plan whose *measured* peak fits, searched over the planning target.

    The target starts at the budget; a measured overshoot lowers it by the overshoot, a measured slack raises it by
    the slack (a cheaper plan may fit too), bisecting once both sides are known. Up to :data:`MAX_PROBES` plans are
    measured; the cheapest that fits is kept, else every layer of ``candidates`` in full if that fits.
    """
    def replan(target: int) -> CheckpointPlan:
        return plan_recompute(savings, baseline, target, costs=costs, recompute_overhead=overhead,
                              activation_bytes=acts)

    target, tried = budget, {}
    best: tuple[CheckpointPlan, int] | None = None
    low, high = None, None  # targets known to give a fitting / an overshooting plan
    for _ in range(MAX_PROBES):
        try:
            plan = replan(max(0, target))
        except ValueError:
            if best is None and not tried:
                raise  # states the best predicted peak
            break
        key = tuple(plan.modes.items())
        if key in tried:
            break
        got = tried[key] = peak(plan.modes) if plan.layers else measured["none"]
        if got <= budget:
            if best is None or plan.predicted_cost < best[0].predicted_cost:
                best = (plan, got)
            low = target
        else:
            high = target
        target = (low + high) // 2 if low is not None and high is not None else target + budget - got
    if best is not None:
        return best
    if measured["full"] > budget:
        raise _unreachable(budget, min([*tried.values(), *measured.values()]), measured["none"])
    plan.layers, plan.selective = list(candidates), []
    plan.predicted_peak, plan.predicted_cost = measured["full"], sum(c["full"] for c in costs.values())
    return plan, measured["full"]
