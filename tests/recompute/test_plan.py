import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_memkit.memory import plan_checkpointing
from lightning_memkit.recompute.plan import (
    RecomputeCostMeter,
    best_peak,
    calibrate,
    calibrate_activations,
    layer_savings,
    mixed_peak,
    plan_recompute,
    predicted_peak,
)


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


def _reference_peak(savings, baseline, modes, overhead, acts):
    """The mixed peak model written out: the selective term, and the term of the last full layer's recompute
    (the layers after it have freed everything they saved; without ``acts`` nothing is counted as freed)."""
    if not modes:
        return baseline
    names = list(savings)
    saved = [savings[n][modes[n]] if n in modes else 0 for n in names]
    peak = baseline - sum(saved) + (overhead["selective"] if "selective" in modes.values() else 0)
    fulls = [i for i, n in enumerate(names) if modes.get(n) == "full"]
    if fulls:
        i = fulls[-1]
        freed = sum(acts[n] for n in names[i + 1:]) if acts is not None else sum(saved[i + 1:])
        peak = max(peak, baseline - sum(saved[:i + 1]) - freed + overhead["full"])
    return peak


def _brute_force_cheapest(savings, costs, baseline, budget, overhead, acts=None):
    """(least cost, lowest peak) over every none/selective/full assignment (least cost None: none fits)."""
    best, lowest = None, baseline
    for choice in itertools.product((None, "selective", "full"), repeat=len(savings)):
        modes = {n: m for n, m in zip(savings, choice) if m is not None}
        if any(savings[n][m] <= 0 for n, m in modes.items()):
            continue  # the planner never recomputes a layer in a mode that saves nothing
        peak = _reference_peak(savings, baseline, modes, overhead, acts)
        assert mixed_peak(savings, baseline, modes, overhead, acts) == peak
        lowest = min(lowest, peak)
        if peak <= budget:
            cost = sum(costs[n][m] for n, m in modes.items())
            best = cost if best is None else min(best, cost)
    return best, lowest


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(-5, 60), st.integers(0, 100), st.integers(0, 9), st.integers(0, 20),
                            st.integers(0, 40)), min_size=1, max_size=5),
    baseline=st.integers(min_value=0, max_value=400),
    budget=st.integers(min_value=0, max_value=400),
    overhead=st.tuples(st.integers(0, 30), st.integers(0, 60)),
    with_acts=st.booleans(),
)
def test_mixed_plan_is_the_cheapest_of_all_assignments(rows, baseline, budget, overhead, with_acts):
    savings = {f"l{i}": {"selective": s, "full": f} for i, (s, f, _, _, _) in enumerate(rows)}
    costs = {f"l{i}": {"selective": cs, "full": cf} for i, (_, _, cs, cf, _) in enumerate(rows)}
    # what a layer saves with nothing recomputed: its full saving plus its inputs (kept by full recompute)
    acts = {f"l{i}": max(s, f) + kept for i, (s, f, _, _, kept) in enumerate(rows)} if with_acts else None
    ovh = {"selective": overhead[0], "full": overhead[1]}
    expected, lowest = _brute_force_cheapest(savings, costs, baseline, budget, ovh, acts)
    if baseline <= budget:
        assert plan_recompute(savings, baseline, budget, costs, ovh, acts).layers == []
        return
    if expected is None:
        with pytest.raises(ValueError, match=f"cannot be reached: the best achievable peak is {lowest} bytes"):
            plan_recompute(savings, baseline, budget, costs, ovh, acts)
        return
    plan = plan_recompute(savings, baseline, budget, costs, ovh, acts)
    assert plan.predicted_cost == expected
    assert plan.predicted_peak == _reference_peak(savings, baseline, plan.modes, ovh, acts) <= budget
    assert plan.predicted_cost == sum(costs[n][m] for n, m in plan.modes.items())


def test_full_recompute_peak_counts_what_later_layers_freed():
    """F S S S: the full recompute of b0 runs after b1..b3 freed their 20 bytes each; the selective term decides."""
    names = [f"b{i}" for i in range(4)]
    savings = dict.fromkeys(names, {"selective": 5, "full": 15})
    costs = dict.fromkeys(names, {"selective": 1.0, "full": 3.5})
    acts, ovh = dict.fromkeys(names, 20), {"selective": 2, "full": 10}
    fsss = {"b0": "full", "b1": "selective", "b2": "selective", "b3": "selective"}
    # selective term 100 - 30 + 2 = 72; full term 100 - 15 - 3 * 20 + 10 = 35
    assert mixed_peak(savings, 100, fsss, ovh, acts) == 72
    assert mixed_peak(savings, 100, fsss, ovh) == 80  # without activation bytes: 100 - 30 + 10
    # the last layer in full frees nothing after it: 100 - 30 + 10 = 80 either way
    sssf = {"b0": "selective", "b1": "selective", "b2": "selective", "b3": "full"}
    assert mixed_peak(savings, 100, sssf, ovh, acts) == 80
    plan = plan_recompute(savings, 100, 75, costs, ovh, acts)
    assert plan.modes == fsss and plan.predicted_peak == 72 and plan.predicted_cost == 6.5
    # the old charge (full overhead on top of every saving) needs 35 bytes saved: F F S - at cost 8
    old = plan_recompute(savings, 100, 75, costs, ovh)
    assert old.modes == {"b0": "full", "b1": "full", "b2": "selective"} and old.predicted_peak == 75
    assert old.predicted_cost == 8.0
    # below 72 F S S S no longer fits: two layers in full (F F - -: 100 - 30 = 70, full term 100 - 30 - 40 + 10)
    plan = plan_recompute(savings, 100, 71, costs, ovh, acts)
    assert plan.modes == {"b0": "full", "b1": "full"} and plan.predicted_peak == 70 and plan.predicted_cost == 7.0


def test_mixed_plan_prefers_selective_then_upgrades_to_full():
    savings = {f"b{i}": {"selective": 20, "full": 50} for i in range(4)}
    costs = {f"b{i}": {"selective": 1.0, "full": 3.5} for i in range(4)}
    plan = plan_recompute(savings, baseline_peak=300, budget_bytes=230, costs=costs)
    assert plan.modes == dict.fromkeys(["b0", "b1", "b2", "b3"], "selective") and plan.predicted_peak == 220
    plan = plan_recompute(savings, baseline_peak=300, budget_bytes=200, costs=costs)  # 80 selective is not enough
    assert plan.modes == {"b0": "full", "b1": "selective", "b2": "selective", "b3": "selective"}
    assert plan.selective == ["b1", "b2", "b3"] and plan.predicted_peak == 190 and plan.predicted_cost == 6.5
    assert plan.saved_bytes == 110 and "b0 (full)" in str(plan)
    plan = plan_recompute(savings, baseline_peak=300, budget_bytes=100, costs=costs)
    assert plan.modes == dict.fromkeys(["b0", "b1", "b2", "b3"], "full") and plan.predicted_peak == 100
    # full cheaper per byte than selective: no selective at all
    cheap_full = {f"b{i}": {"selective": 1.0, "full": 1.5} for i in range(4)}
    assert set(plan_recompute(savings, 300, 200, cheap_full).modes.values()) == {"full"}


def test_mixed_plan_errors():
    savings = {"a": {"selective": 10, "full": 30}}
    with pytest.raises(ValueError, match=r"budget_bytes=10 cannot be reached: the best achievable peak is 75 bytes"):
        plan_recompute(savings, baseline_peak=100, budget_bytes=10, recompute_overhead={"full": 5})
    with pytest.raises(ValueError, match=r"plan_recompute\(savings\['a'\]=\{'full': 3\}\): must map exactly"):
        plan_recompute({"a": {"full": 3}}, 100, 50)
    with pytest.raises(TypeError, match=r"plan_recompute\(savings=...\) must be a mapping"):
        plan_recompute([1], 100, 50)
    with pytest.raises(ValueError, match=r"plan_recompute\(costs\['a'\]\['full'\]=-1\): must be a finite number >= 0"):
        plan_recompute(savings, 100, 50, costs={"a": {"selective": 1, "full": -1}})
    with pytest.raises(ValueError, match=r"costs=...\) must name the same layers as savings"):
        plan_recompute(savings, 100, 50, costs={"b": {"selective": 1, "full": 2}})
    with pytest.raises(ValueError, match=r"plan_recompute\(recompute_overhead\['full'\]=-1\): must be an int >= 0"):
        plan_recompute(savings, 100, 50, recompute_overhead={"full": -1})
    with pytest.raises(TypeError, match=r"plan_recompute\(activation_bytes=...\) must be a mapping"):
        plan_recompute(savings, 100, 50, activation_bytes=[3])
    with pytest.raises(ValueError, match=r"activation_bytes=...\) must name the same layers as savings"):
        plan_recompute(savings, 100, 50, activation_bytes={"b": 3})
    with pytest.raises(ValueError, match=r"plan_recompute\(activation_bytes\['a'\]=-2\): must be an int >= 0"):
        plan_recompute(savings, 100, 50, activation_bytes={"a": -2})


def test_calibrate_reproduces_the_measured_all_layer_peaks():
    savings = {"a": {"selective": 10, "full": 40}, "b": {"selective": 10, "full": 40}}
    overhead = {"selective": 4, "full": 8}
    measured = {"none": 150, "selective": 142, "full": 114}  # profiled: 200 - 20 + 4, 200 - 80 + 8
    baseline, fitted, ovh = calibrate(savings, overhead, measured)
    assert baseline == 150
    for mode in ("selective", "full"):
        assert mixed_peak(fitted, baseline, {"a": mode, "b": mode}, ovh) == measured[mode]
    acts = calibrate_activations({"a": 50, "b": 60}, savings, overhead, measured)
    assert acts == {"a": 25, "b": 30}  # scaled as the full savings: (150 - 114) / (80 - 8) = 0.5
    assert fitted["a"]["full"] == 20


def test_cost_meter_times_each_layer_forward_only():
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    with RecomputeCostMeter([("0", net[0]), ("1", net[1])]) as meter:
        net(torch.randn(8, 16, requires_grad=True)).sum().backward()
    assert meter.costs["0"]["full"] > 0 and meter.costs["0"]["selective"] < meter.costs["0"]["full"]  # addmm saved
    assert meter.costs["1"]["selective"] == meter.costs["1"]["full"] > 0  # GELU: nothing kept by selective
    assert not net[0]._forward_hooks and not net[0]._forward_pre_hooks  # hooks removed on exit
