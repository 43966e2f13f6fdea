"""memkit estimate --budget: a plan keeps the config's own settings; the search reports estimates done, planned, ETA."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from lightning_memkit.estimate.config_run import ConfigRun
from lightning_memkit.estimate.levers import Plan
from lightning_memkit.estimate.plans import TIE, search_plans
from lightning_memkit.estimate.runs import LeverRun
from lightning_memkit.measure.machine import MachineBalance

BALANCE = MachineBalance("300 FLOP per byte", {"float32": 1.0}, memory_bytes_per_s=1 / 300, link_bytes_per_s=1.0)

TINY_LM = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny_lm.yaml"


def _callback(fragment: dict, name: str) -> dict:
    found = [c for c in fragment["trainer"]["callbacks"] if c["class_path"].endswith("." + name)]
    assert len(found) == 1, fragment
    return found[0]


@pytest.fixture(scope="module")
def tiny_lm_run(tmp_path_factory: pytest.TempPathFactory) -> ConfigRun:
    """tiny_lm.yaml, its ActivationCheckpointing within ``budget_bytes`` too."""
    import yaml

    config = yaml.safe_load(TINY_LM.read_text())
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith(".ActivationCheckpointing"):
            callback["init_args"]["budget_bytes"] = 50_000_000
    path = tmp_path_factory.mktemp("plans") / "tiny_lm.yaml"
    path.write_text(yaml.safe_dump(config))
    return ConfigRun(path, ["--model.n_layers", "1", "--data.init_args.batch_size", "4"])


@pytest.mark.parametrize("checkpoint", ["full", "selective"])
def test_a_plan_keeps_the_configs_activation_checkpointing_settings(checkpoint: str, tiny_lm_run: ConfigRun) -> None:
    """tiny_lm.yaml recomputes ``policy: [Block]`` (and here within ``budget_bytes``): the plans' YAML says so too
    (it once came back as ``selective: false`` alone, the rest dropped), with the plan's mode."""
    run = tiny_lm_run
    assert run.base["recompute"] == "full"
    plan = Plan(precision=run.base["precision"], recompute=checkpoint, fused_loss=False, micro_batch=2)
    edited = run.edited(plan)
    args = _callback(edited, "ActivationCheckpointing")["init_args"]
    assert args["policy"] == ["lightning_memkit.demo.tiny_lm.Block"] and args["budget_bytes"] == 50_000_000
    assert args["selective"] is (checkpoint == "selective")
    assert edited["data"]["init_args"]["batch_size"] == 2
    # the callback stays where the config has it; the fragment lists the callbacks only where the plan changes one
    names = [c["class_path"] for c in edited["trainer"]["callbacks"]]
    assert names == [c["class_path"] for c in run.parsed["trainer"]["callbacks"]]
    fragment = run.fragment(plan)["trainer"]
    assert ("callbacks" in fragment) is (checkpoint == "selective") and "precision" not in fragment
    if checkpoint == "selective":
        assert _callback(run.fragment(plan), "ActivationCheckpointing")["init_args"] == args


@dataclass
class _Estimate:
    peak_bytes: int
    step_flops: int = 1
    step_bytes: int = 0


class _Run(LeverRun):
    """A run whose peak is the micro-batch in bytes: plans of micro-batch <= 2 fit a budget of 2."""

    def __init__(self) -> None:
        self.base = Plan(recompute=None, fused_loss=False, micro_batch=8)
        self.batch_size = 8

    def axes(self):
        for micro in (8, 4, 2, 1):
            for checkpoint in (None, "full"):
                yield Plan(recompute=checkpoint, fused_loss=False, micro_batch=micro)

    def estimate(self, plan: Plan) -> _Estimate:
        return _Estimate(plan["micro_batch"])

    def pipelines(self):
        return iter(())

    def fragment(self, plan: Plan) -> dict:
        return {"trainer": {"accumulate_grad_batches": self.batch_size // plan["micro_batch"]}}

    def notes(self, plan: Plan) -> list[str]:
        return []


def test_the_search_says_estimates_done_and_planned_and_the_time_left() -> None:
    lines: list[str] = []
    result = search_plans(_Run(), 2, margin=0.0, progress=lines.append, machine=BALANCE)
    assert len(lines) == result.estimated and result.fitting
    assert re.fullmatch(r"estimate 1/\d+: the run as given", lines[0])
    done_planned = [tuple(map(int, re.match(r"estimate (\d+)/(\d+): ", line).groups())) for line in lines]
    assert [d for d, _ in done_planned] == list(range(1, len(lines) + 1))
    assert all(d <= p for d, p in done_planned) and done_planned[-1][1] <= done_planned[0][1]  # planned only falls
    assert all(re.search(r"\(\d+ s so far, about \d+ s left\)$", line) for line in lines[1:])
    assert result.seconds >= 0 and f"searched in {result.seconds:.1f} s" in str(result)


class _Lattice(_Run):
    """Recompute x fused loss x micro-batch: peaks fall and costs rise with each axis (as the estimator's do)."""

    ACTIVATIONS = {None: 1.0, "selective": 0.9, "full": 0.3}
    WORK = {None: 1.0, "selective": 1.05, "full": 1.33}

    def axes(self):
        for micro in (8, 4, 2, 1):
            for checkpoint in (None, "selective", "full"):
                for fused in (False, True):
                    yield Plan(recompute=checkpoint, fused_loss=fused, micro_batch=micro)

    def estimate(self, plan: Plan) -> _Estimate:
        fused = 0.8 if plan["fused_loss"] else 1
        peak = 10 + 100 * plan["micro_batch"] / 8 * self.ACTIVATIONS[plan["recompute"]] * fused
        flops = 1000 * plan["micro_batch"] / 8 * self.WORK[plan["recompute"]] * (0.99 if plan["fused_loss"] else 1)
        return _Estimate(round(peak), round(flops) + 8 // plan["micro_batch"])  # + a little per accumulation step


@pytest.mark.parametrize("budget", [15, 25, 40, 60, 90])
def test_the_search_finds_the_cheapest_fitting_plan_with_fewer_estimates(budget: int) -> None:
    """Probing the strongest plan one axis at a time rules out faces of the plans; plan 1 is still the cheapest of
    all the plans that fit (of those tied with it within 5%, the one changing fewest levers), as estimating every
    one of them finds it."""
    from lightning_memkit.estimate.plans import step_cost

    run = _Lattice()
    result = search_plans(run, budget, margin=0.0, machine=BALANCE)
    costs = {p: step_cost(run.estimate(p), BALANCE).micro * (8 // p["micro_batch"]) for p in run.axes()
             if run.estimate(p).peak_bytes <= budget}
    cheapest = min(costs.values())
    tied = [p for p, c in costs.items() if c <= cheapest * (1 + TIE)]  # the model cannot tell them apart
    assert result.fitting[0].plan == min(tied, key=lambda p: (p.changes(run.base), p.search_order(run.base), costs[p]))
    assert result.estimated + result.skipped == len(list(run.axes()))
    if budget == 15:  # tight: only full recomputation of small micro-batches fits; the probes rule out most plans
        assert result.estimated <= len(list(run.axes())) // 2


def test_the_strongest_plan_is_probed_only_under_a_tight_budget() -> None:
    """Right after the strongest plan (peak 13; the run as given: 110, their geometric mean 38), a budget of 25
    probes it one axis weaker; at 90 a probe would fit and rule nothing out, and the search goes on with the least
    added work."""
    from lightning_memkit.estimate.plans import _probes

    run = _Lattice()
    top = Plan(recompute="full", fused_loss=True, micro_batch=1)
    probes = {p.describe(run.base) for p in _probes(top, [p for p in run.axes() if p != run.base])}
    for budget, probed in ((25, True), (90, False)):
        lines: list[str] = []
        search_plans(run, budget, margin=0.0, machine=BALANCE, progress=lines.append)
        tried = [line.split(": ", 1)[1].split(" (")[0] for line in lines]
        assert tried[1] == top.describe(run.base)
        assert (tried[2] in probes) is probed, (budget, tried)


@pytest.mark.parametrize("budget", [25, 90])
def test_plans_priced_above_one_beyond_the_tie_band_are_not_estimated(budget: int, monkeypatch) -> None:
    """A plan priced at least as high as one already estimated beyond the tie band of the cheapest fitting plan can
    be neither the cheapest nor tied with it: skipped, the same plan chosen with fewer estimates."""
    with_rule = search_plans(_Lattice(), budget, margin=0.0, machine=BALANCE)
    monkeypatch.setattr(Plan, "costs_at_least", lambda self, other: False)
    without = search_plans(_Lattice(), budget, margin=0.0, machine=BALANCE)
    assert with_rule.fitting[0].plan == without.fitting[0].plan
    assert with_rule.estimated < without.estimated


def test_costs_at_least_reads_work_up_reorders_down_and_the_rest_alike() -> None:
    base = Plan(micro_batch=8, optimizer_in_backward=True)
    assert base.replace(recompute="full").costs_at_least(base)  # more work
    assert base.replace(optimizer_in_backward=False).costs_at_least(base)  # the same ops, in Lightning's order
    assert not base.costs_at_least(base.replace(recompute="full"))
    assert not base.replace(fused_loss=True).costs_at_least(base)  # the fused loss may cost more or less
    assert not base.costs_at_least(base.replace(fused_loss=True))


def test_keep_base_stops_at_a_run_that_fits_as_given() -> None:
    """``MemoryBudget``'s search: a run that fits as given is the answer after one estimate, nothing ranked;
    ``memkit estimate --budget`` (without it) searches on for plans cheaper than the run as given."""
    kept = search_plans(_Lattice(), 200, margin=0.0, machine=BALANCE, keep_base=True)
    assert kept.base.fits and [r.plan for r in kept.fitting] == [kept.base.plan] and kept.estimated == 1
    assert kept.machine == "" and kept.skipped == len(list(_Lattice().axes())) - 1
    searched = search_plans(_Lattice(), 200, margin=0.0, machine=BALANCE)
    assert searched.estimated > 1 and searched.machine == BALANCE.device
    assert search_plans(_Lattice(), 60, margin=0.0, machine=BALANCE, keep_base=True).estimated > 1  # does not fit


class _TwoWays(_Run):
    """Two plans that fit 80 within 5% of each other's predicted step time: the fused loss (fewer FLOPs, more bytes
    per step) and micro-batches of 4 (the run's FLOPs and bytes, as the step time model prices a split: no less than
    the run as given); which is cheaper depends on the balance."""

    def axes(self):
        yield self.base
        yield self.base.replace(fused_loss=True)
        yield self.base.replace(micro_batch=4)

    def estimate(self, plan: Plan) -> _Estimate:
        if plan["fused_loss"]:
            return _Estimate(70, 900, 255)
        if plan["micro_batch"] == 4:
            return _Estimate(60, 500, 100)  # per micro-batch: twice per step
        return _Estimate(100, 1000, 200)


def test_plans_the_model_cannot_tell_apart_rank_the_same_on_a_noisy_balance(monkeypatch) -> None:
    """A probe 10% off in its GEMM rate (a busy machine) flips which of the two is cheaper; within the tie band the
    plan adding no work ranks first on both balances."""
    import lightning_memkit.estimate.plans as plans

    balances = [MachineBalance("idle", {"float32": 1.0}, memory_bytes_per_s=1.0, link_bytes_per_s=1.0),
                MachineBalance("busy", {"float32": 0.9}, memory_bytes_per_s=1.0, link_bytes_per_s=1.0)]
    chosen = [search_plans(_TwoWays(), 80, margin=0.0, machine=m).fitting[0].plan for m in balances]
    assert chosen[0] == chosen[1] == _TwoWays().base.replace(fused_loss=True)
    monkeypatch.setattr(plans, "TIE", 0.0)  # the cheapest alone: the balance decides
    cheapest = [search_plans(_TwoWays(), 80, margin=0.0, machine=m).fitting[0].plan for m in balances]
    assert cheapest[0] != cheapest[1]
