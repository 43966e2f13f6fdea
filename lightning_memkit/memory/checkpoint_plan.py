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

Example::

    >>> from lightning_memkit.memory import plan_checkpointing
    >>> plan = plan_checkpointing({"blocks.0": 30, "blocks.1": 50, "blocks.2": 40}, baseline_peak=200,
    ...                           budget_bytes=120)
    >>> plan.layers, plan.predicted_peak
    (['blocks.1', 'blocks.2'], 110)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lightning_memkit.validation import check_int

__all__ = ["CheckpointPlan", "plan_checkpointing", "layer_savings", "predicted_peak"]


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

    def first(self, k: int) -> list[str]:
        """The ``k`` largest-saving layers, in model order (what the plan picks when ``k`` layers are needed)."""
        order = {name: i for i, name in enumerate(self.savings)}
        return sorted(self.ranked[:k], key=order.__getitem__)

    @property
    def best_peak(self) -> int:
        """The predicted peak with every layer that saves anything recomputed."""
        return best_peak(self.savings, self.baseline_peak, self.recompute_overhead)

    def __str__(self) -> str:
        names = ", ".join(self.layers) if self.layers else "none"
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
