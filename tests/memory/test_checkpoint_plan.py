import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_memkit.memory import plan_checkpointing
from lightning_memkit.memory.checkpoint_plan import best_peak, layer_savings, predicted_peak


def _brute_force_min(savings, baseline, budget, overhead):
    names = list(savings)
    for k in range(len(names) + 1):
        for subset in itertools.combinations(names, k):
            if predicted_peak(savings, baseline, list(subset), overhead) <= budget:
                return k
    return None


@settings(max_examples=300, deadline=None)
@given(
    savings=st.lists(st.integers(min_value=-5, max_value=100), min_size=1, max_size=7),
    baseline=st.integers(min_value=0, max_value=600),
    budget=st.integers(min_value=0, max_value=600),
    overhead=st.integers(min_value=0, max_value=60),
)
def test_greedy_plan_uses_the_fewest_layers_of_all_subsets(savings, baseline, budget, overhead):
    named = {f"layer{i}": s for i, s in enumerate(savings)}
    expected = _brute_force_min(named, baseline, budget, overhead)
    if expected is None:
        with pytest.raises(ValueError, match=f"best achievable peak is {best_peak(named, baseline, overhead)} bytes"):
            plan_checkpointing(named, baseline, budget, overhead)
        return
    plan = plan_checkpointing(named, baseline, budget, overhead)
    assert len(plan.layers) == expected
    assert plan.predicted_peak == predicted_peak(named, baseline, plan.layers, overhead) <= budget
    assert plan.layers == [n for n in named if n in plan.layers]  # model order
    if expected:  # the lowest peak among the sets of that size
        sets = itertools.combinations(named, expected)
        lowest = min(predicted_peak(named, baseline, list(c), overhead) for c in sets)
        assert plan.predicted_peak == lowest


def test_budget_above_baseline_needs_nothing():
    plan = plan_checkpointing({"a": 10}, baseline_peak=100, budget_bytes=100)
    assert plan.layers == [] and plan.predicted_peak == 100


def test_unreachable_budget_states_best_peak():
    with pytest.raises(ValueError, match=r"budget_bytes=50 cannot be reached: the best achievable peak is 75 bytes"):
        plan_checkpointing({"a": 10, "b": 20, "c": 0}, baseline_peak=100, budget_bytes=50, recompute_overhead=5)


def test_ties_pick_earlier_layers():
    plan = plan_checkpointing({"b0": 10, "b1": 10, "b2": 10}, baseline_peak=100, budget_bytes=80)
    assert plan.layers == ["b0", "b1"] and plan.ranked == ["b0", "b1", "b2"] and plan.first(1) == ["b0"]


def test_argument_errors():
    with pytest.raises(TypeError, match="savings must be a mapping"):
        plan_checkpointing([10], 100, 50)
    with pytest.raises(TypeError, match=r"plan_checkpointing\(savings\['a'\]=1.5\): must be an int, got float"):
        plan_checkpointing({"a": 1.5}, 100, 50)
    with pytest.raises(ValueError, match=r"plan_checkpointing\(budget_bytes=-1\): must be an int >= 0"):
        plan_checkpointing({"a": 1}, 100, -1)
    with pytest.raises(ValueError, match=r"plan_checkpointing\(recompute_overhead=-3\): must be an int >= 0"):
        plan_checkpointing({"a": 1}, 100, 50, recompute_overhead=-3)


def test_layer_savings_subtracts_kept_inputs():
    assert layer_savings({"a": 100, "b": 10}, {"a": 30, "b": 50}) == {"a": 70, "b": 0}
