"""``memkit estimate --budget``: the cheapest feature plans whose predicted training peak fits a memory budget.

A :class:`~lightning_memkit.estimate.levers.plan.Plan` maps each lever of
:mod:`~lightning_memkit.estimate.levers` (precision, quantization, recompute, fused loss, micro-batch, pipeline
stages: one module each) to a choice; a run (:class:`~lightning_memkit.estimate.runs.Run`: an HF config, a LightningCLI
config, a module as built) offers the product of its levers' options. Every candidate is estimated with
:func:`~lightning_memkit.memory.estimate_training_memory` (its real step on fake tensors); a candidate weaker than or
equal on every lever to one that does not fit is skipped without being estimated (each lever only lowers the peak).
A plan fits when its predicted peak, plus ``margin`` of it (the estimator's accuracy goal, 5%), is within the budget,
and what it keeps in host memory (offloaded activations, an offloaded optimizer) is free on this host now.
This module knows no concrete run.

**Step time model** (a prediction, used for ranking; :class:`StepCost`): a micro-batch costs its matmul and attention
FLOPs (counted by :class:`torch.utils.flop_counter.FlopCounterMode` on the fake step, recomputation included) at the
training device's GEMM rate for the compute dtype, plus twice the bytes its other operators write (one write, one
read) at its memory bandwidth; ``optimizer.step()`` runs once per optimizer step, whatever the micro-batches. The
rates are the device's own (:func:`~lightning_memkit.measure.machine.probe_machine`: measured once, cached), or an
H100's (:data:`~lightning_memkit.measure.machine.H100`) for a CUDA device this machine does not have. A plan's
overhead is its step time over the given run's, minus one; a pipeline of ``S`` stages and ``M`` microbatches divides
the time by ``S`` and adds the 1F1B bubble ``(S - 1) / M``. Not modeled: slower small GEMMs after a micro-batch
split, kernel launch costs, communication.

Example (a one-layer tiny Llama: plans for half of its plain peak, four estimates at most)::

    >>> import pathlib, tempfile
    >>> from lightning_memkit.demo.hf_models import tiny_hf_config
    >>> from lightning_memkit.estimate.hf_run import HFRun
    >>> from lightning_memkit.estimate.plans import search_plans
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "config.json"
    >>> _ = path.write_text(tiny_hf_config("llama", vocab_size=1000, num_layers=1).to_json_string())
    >>> run = HFRun(path, seq_len=64, batch_size=2)
    >>> result = search_plans(run, budget_bytes=run.estimate(run.base).peak_bytes // 2, max_estimates=4)
    >>> best = result.fitting[0]
    >>> best.peak_bytes * 1.05 <= result.budget_bytes, "trainer:" in best.yaml()
    (True, True)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_memkit.estimate.levers import Plan, StepCost
from lightning_memkit.estimate.runs import Run
from lightning_memkit.estimate.step import MemoryEstimate
from lightning_memkit.measure.device import free_device_memory
from lightning_memkit.measure.machine import MachineBalance, step_seconds
from lightning_memkit.measure.storage import format_bytes

__all__ = ["Plan", "PlanResult", "SearchResult", "StepCost", "search_plans", "step_cost", "strongest_fits"]


def step_cost(est: MemoryEstimate, machine: MachineBalance, dtype: str = "float32") -> StepCost:
    """The step time model (module doc) of one traced step: per micro-batch and once per optimizer step."""
    once = getattr(est, "optimizer_step_bytes", 0)
    return StepCost(step_seconds(machine, est.step_flops, est.step_bytes - once, dtype=dtype),
                    step_seconds(machine, 0, once, dtype=dtype))


@dataclass
class PlanResult:
    """A plan, its predicted peak (per rank with pipeline stages) and step time overhead, and its YAML."""

    plan: Plan
    peak_bytes: int
    overhead: float
    fits: bool
    run: Any = field(repr=False, default=None)
    host_bytes: int = 0  # what the plan keeps in host memory (offloaded), apart from the device peak
    step_seconds: float = 0.0  # the step time model's seconds for one optimizer step on the search's machine

    def yaml(self) -> str:
        """A LightningCLI YAML fragment to pass after the run's own config (``--config base.yaml --config this``)."""
        import yaml

        per = " per rank" if self.plan.devices() > 1 or getattr(self.run, "devices", 1) > 1 else ""
        host = f" and {format_bytes(self.host_bytes)} of host memory{per}" if self.host_bytes else ""
        head = (f"# {self.plan.describe(self.run.base)}: predicted peak {format_bytes(self.peak_bytes)}"
                f"{per}{host}, step time {self.overhead:+.0%} "
                "(predicted)\n")
        notes = "".join(f"# {n}\n" for n in self.run.notes(self.plan))
        return head + notes + yaml.safe_dump(self.run.fragment(self.plan), sort_keys=False)


@dataclass
class SearchResult:
    """Every plan estimated, the fitting ones cheapest first, and the counts of the search."""

    budget_bytes: int
    margin: float
    base: PlanResult
    fitting: list[PlanResult]
    estimated: int
    skipped: int
    capped: int = 0
    seconds: float = 0.0
    machine: str = ""  # the device balance the plans were ranked with (its name; "": nothing was ranked)

    def to_json(self) -> str:
        import json

        def row(r: PlanResult) -> dict[str, Any]:
            return {"plan": r.plan.describe(self.base.plan), "peak_bytes": r.peak_bytes, "host_bytes": r.host_bytes,
                    "overhead": round(r.overhead, 4), "step_seconds": round(r.step_seconds, 4), "yaml": r.yaml(),
                    **r.plan.to_dict()}

        return json.dumps({"budget_bytes": self.budget_bytes, "margin": self.margin, "base": row(self.base),
                           "plans": [row(r) for r in self.fitting], "estimated": self.estimated,
                           "skipped": self.skipped, "not_estimated_max_estimates": self.capped,
                           "seconds": round(self.seconds, 1), "machine": self.machine}, indent=2)

    def __str__(self) -> str:
        lines = [f"budget {format_bytes(self.budget_bytes)} ({self.budget_bytes:,} B), {self.margin:.0%} margin; "
                 f"the run as given peaks at {format_bytes(self.base.peak_bytes)} "
                 f"({'fits' if self.base.fits else 'does not fit'})",
                 f"{self.estimated} plans estimated, {self.skipped} ruled out without an estimate"
                 + (f", {self.capped} left out by the estimate limit (raise --max-estimates)" if self.capped else "")
                 + f"; searched in {self.seconds:.1f} s"
                 + (f"; ranked by step time on {self.machine}" if self.machine else "")]
        if not self.fitting:
            lines.append("no plan fits: a larger budget, a shorter sequence or more pipeline stages is needed")
        for i, r in enumerate(self.fitting, 1):
            lines += ["", f"plan {i}:", r.yaml().rstrip()]
        return "\n".join(lines)


#: plans whose predicted step times are within this fraction of the cheapest one's are a tie: the step time model's
#: own error on measured steps is of this order (``benchmarks/bench_step_time.py``), and a machine probe measured while
#: busy moves their order by as much; among them the plan changing fewer levers ranks first
TIE = 0.05


# -- the search --------------------------------------------------------------------------------------------------
def _within(est: Any, budget_bytes: int, margin: float) -> bool:
    """The step's device peak, with the margin, within the budget."""
    return est.peak_bytes * (1 + margin) <= budget_bytes


def _fits(est: Any, run: Any, budget_bytes: int, margin: float, host_free: int | None) -> bool:
    """Within the budget, and the host memory it needs free now (a pinned page cannot be swapped): every rank of
    the run's devices (one machine's) keeps its own."""
    host = getattr(est, "host_bytes", 0) * getattr(run, "devices", 1)
    return _within(est, budget_bytes, margin) and (not host or host_free is None or host <= host_free)


def strongest_fits(run: Run, budget_bytes: int, *, margin: float = 0.05,
                   host_budget: int | None = None) -> tuple[bool, int]:
    """Whether one of ``run``'s strongest plans fits (each lever at its strongest; where they miss only the host
    memory, the strongest that keep nothing on the host), and the smallest device peak estimated: if none fits,
    no plan of the run does."""
    host_free = host_budget if host_budget is not None else free_device_memory("cpu")
    plans = [run.base, *run.axes()]
    tops = _strongest(plans)
    smallest = None
    for plan in tops:
        est = run.estimate(plan)
        smallest = est.peak_bytes if smallest is None else min(smallest, est.peak_bytes)
        if _fits(est, run, budget_bytes, margin, host_free):
            return True, est.peak_bytes
        if _within(est, budget_bytes, margin) and plan.uses_host():
            tops += _host_free_tops(plans, tops)
    return False, smallest or 0


def _host_free_tops(plans: list[Plan], tops: list[Plan]) -> list[Plan]:
    """The strongest of ``plans`` that keep nothing in host memory, those not in ``tops`` already: where the
    strongest miss only the host memory, the plans to try next."""
    return [p for p in _strongest([p for p in plans if not p.uses_host()]) if p not in tops]


def _strongest(plans: list[Plan]) -> list[Plan]:
    """The plans no other one is stronger than, strongest first: one plan (each lever at its strongest) where the levers
    combine freely, several where some choices exclude each other (the optimizer-state levers)."""
    tops: list[Plan] = []
    for plan in sorted(plans, key=lambda p: p.strength(), reverse=True):
        if not any(plan.at_most(top) for top in tops):
            tops.append(plan)
    return tops


def _probes(top: Plan, plans: list[Plan]) -> list[Plan]:
    """Per axis with a weaker choice, the strongest plan ``top`` with that axis one step weaker. Estimated right
    after ``top`` when it fits and the run as given does not: a probe that does not fit rules out every plan at
    most as strong on that axis (all other axes are at most ``top``'s), a face of the plans at one estimate; under a
    tight budget most of the plans go that way. A probe that fits is a plan like any other."""
    strongest = top.strength()
    best: dict[int, Plan] = {}
    for plan in plans:
        strength = plan.strength()
        axes = [i for i, (a, b) in enumerate(zip(strength, strongest, strict=True)) if a != b]
        if len(axes) == 1 and strength[axes[0]] < strongest[axes[0]]:
            i = axes[0]
            if i not in best or strength[i] > best[i].strength()[i]:
                best[i] = plan
    return [best[i] for i in sorted(best)]


def _tight(strongest: tuple[PlanResult, StepCost] | None, base: PlanResult, budget: int, margin: float) -> bool:
    """Whether the strongest plan is probed (:func:`_probes`): it fits, the run as given does not, and the budget is
    below the geometric mean of their peaks (with the margin). The plans' peaks spread between those two; a probe
    rules plans out only when it does not fit, which is likely only where most plans do not fit: under a looser
    budget the probes would fit, estimates that rule nothing out."""
    if strongest is None or base.fits:
        return False
    return budget < (strongest[0].peak_bytes * base.peak_bytes) ** 0.5 * (1 + margin)


@dataclass
class _Search:
    """The state of one :func:`search_plans`."""

    run: Any
    machine: MachineBalance
    fits: Callable[[Any], bool]
    say: Callable[[str], None]
    max_estimates: int
    device_fits: Callable[[Any], bool] = bool
    fitting: list[PlanResult] = field(default_factory=list)
    failed: list[Plan] = field(default_factory=list)  # over the device budget: a weaker plan cannot fit either
    host_failed: list[Plan] = field(default_factory=list)  # within it, over the host memory: rules nothing out
    estimated: int = 0
    skipped: int = 0
    capped: int = 0  # plans left out by max_estimates
    base_cost: float = 0.0
    queue: list[Plan] = field(default_factory=list)  # the plans still to try, in order (for the progress line)
    done: set[Plan] = field(default_factory=set)  # the plans tried (estimated or ruled out)
    overheads: list[tuple[Plan, float]] = field(default_factory=list)  # every plan estimated, its predicted overhead
    start: float = field(default_factory=time.perf_counter)

    def ruled_out(self, plan: Plan) -> bool:
        """Weaker than a plan that does not fit; or only adding work to one that fits; or priced at least as high
        (:meth:`~lightning_memkit.estimate.levers.plan.Plan.costs_at_least`) as one estimated beyond the tie band of
        the cheapest fitting plan so far (it can neither be the cheapest nor tie with it: the cheapest only gets
        cheaper)."""
        if any(plan.at_most(f) for f in self.failed) or any(plan.costlier(r.plan) for r in self.fitting):
            return True
        if not self.fitting:
            return False
        band = (1 + min(r.overhead for r in self.fitting)) * (1 + TIE)
        return any(1 + overhead > band and plan.costs_at_least(done) for done, overhead in self.overheads)

    def try_plan(self, plan: Plan, single_cost: StepCost | None = None) -> tuple[PlanResult, StepCost] | None:
        """Estimate ``plan`` unless a known result rules it out; file it as fitting or failed."""
        if plan in self.queue:
            self.queue.remove(plan)
        if plan in self.done:
            return None
        self.done.add(plan)
        if self.ruled_out(plan):
            self.skipped += 1
            return None
        if self.estimated >= self.max_estimates:
            self.capped += 1
            return None
        self.say(self._progress(plan))
        est = self.run.estimate(plan)
        self.estimated += 1
        # pipeline stages: the single-device step of the same features, split over the stages
        traced = single_cost if plan.devices() > 1 else step_cost(est, self.machine, self.run.compute_dtype(plan))
        cost = plan.scale_cost(self.run.base, traced, self.run, est, self.machine)
        self.base_cost = self.base_cost or cost.seconds
        result = PlanResult(plan, est.peak_bytes, cost.seconds / self.base_cost - 1, self.fits(est), self.run,
                            getattr(est, "host_bytes", 0), cost.seconds)
        self.overheads.append((plan, result.overhead))
        if result.fits:
            self.fitting.append(result)
        else:  # a weaker plan offloads less: one over the host memory may fit
            (self.host_failed if self.device_fits(est) else self.failed).append(plan)
        return result, cost

    def _progress(self, plan: Plan) -> str:
        """``estimate 3/12: <plan> (40 s so far, about 2 min left)``: the estimates done and planned (this one, and
        those still queued that no result rules out yet: the count can only fall), and the time left at the mean
        time of the estimates so far."""
        planned = self.estimated + 1 + sum(not self.ruled_out(p) for p in self.queue)
        planned = min(planned, self.max_estimates)
        line = f"estimate {self.estimated + 1}/{planned}: {plan.describe(self.run.base)}"
        if self.estimated:
            elapsed = time.perf_counter() - self.start
            left = elapsed / self.estimated * (planned - self.estimated)
            line += f" ({_duration(elapsed)} so far, about {_duration(left)} left)"
        return line


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _ranked(fitting: list[PlanResult], base: Plan) -> list[PlanResult]:
    """``fitting`` cheapest first, except that the plans tied with the cheapest (:data:`TIE`) come first ordered by
    what does not depend on the machine: the levers they change (fewer first), then the work they add (least first;
    :meth:`~lightning_memkit.estimate.levers.plan.Plan.search_order`), then their predicted cost and strength; at
    the same predicted cost a free lever that cuts nothing does not come first."""
    def cost(r: PlanResult) -> tuple:
        return r.plan.devices(), round(r.overhead, 6), r.plan.changes(base), -sum(r.plan.strength())

    ordered = sorted(fitting, key=cost)
    if not ordered:
        return ordered
    best = ordered[0]
    tied = [r for r in ordered if r.plan.devices() == best.plan.devices()
            and 1 + r.overhead <= (1 + best.overhead) * (1 + TIE)]
    tied.sort(key=lambda r: (r.plan.changes(base), r.plan.search_order(base), *cost(r)[1:]))
    return tied + [r for r in ordered if r not in tied]


def search_plans(run: Run, budget_bytes: int, margin: float = 0.05, max_plans: int = 3,
                 max_estimates: int = 48, progress: Callable[[str], None] | None = None,
                 machine: MachineBalance | None = None, host_budget: int | None = None,
                 keep_base: bool = False) -> SearchResult:
    """Estimate the candidate plans of ``run`` and return those that fit ``budget_bytes``, cheapest first.

    Plans whose predicted step times are within :data:`TIE` (5%) of the cheapest rank by the levers they change,
    fewer first: the ranking does not flip on a machine probe's noise between plans the model cannot tell apart.
    The run as given and the strongest plan come first (if that one does not fit, no single-device plan does);
    when only the strongest fits and the budget is below the geometric mean of its peak and the run as given's, it
    is probed with each axis one step weaker (a probe that does not fit rules out that face of the plans); then
    the rest, least added work first, skipping a plan weaker than one that does not fit, or one that only adds
    work to one that fits or costs at least as much as one estimated beyond the tie band of the cheapest fitting
    so far. The cheapest fitting plan is always found (plan 1); the others listed are fitting plans found on the
    way, cheapest first.

    Args:
        run: a :class:`~lightning_memkit.estimate.runs.Run` (:class:`~lightning_memkit.estimate.hf_run.HFRun`,
            :class:`~lightning_memkit.estimate.config_run.ConfigRun`,
            :class:`~lightning_memkit.estimate.module.ModuleRun`); its ``base`` plan is the run as given.
        budget_bytes: device memory available to training (per rank with pipeline stages).
        margin: a plan fits when ``peak * (1 + margin) <= budget_bytes``.
        max_plans: how many fitting plans to return.
        max_estimates: stop after this many estimates.
        progress: called with a line before each estimate: the estimates done and planned, the time so far and the
            time left (``estimate 3/12: <plan> (40 s so far, about 2 min left)``).
        machine: the device balance the step time model prices steps with (``None``: the run's,
            :meth:`~lightning_memkit.estimate.runs.LeverRun.machine`).
        host_budget: host memory a plan may keep offloaded bytes in (``None``: what this machine has free now).
        keep_base: a run as given that fits is the answer: nothing else is estimated (``MemoryBudget`` changes
            nothing in a run that fits; without it, plans cheaper than the run as given are searched too).
    """
    _check_arguments(budget_bytes, margin, max_plans, max_estimates)
    search = _new_search(run, budget_bytes, margin, max_estimates, progress, machine, host_budget)
    ordered = sorted((p for p in run.axes() if p != run.base), key=lambda p: p.search_order(run.base))
    tops = _strongest([run.base, *ordered])
    search.queue = [*tops, *(p for p in ordered if p not in tops)]
    base, base_cost = search.try_plan(run.base)
    if keep_base and base.fits:
        return SearchResult(budget_bytes, margin, base, [base], search.estimated, len(search.queue), 0,
                            time.perf_counter() - search.start)  # nothing ranked
    tried = _try_tops(search, tops, ordered, (base, base_cost))
    open_tops = _open_tops(search, tried)
    if open_tops:
        top, strongest = open_tops[0]
        _try_rest(search, top, ordered, tops, _tight(strongest, base, budget_bytes, margin))
    else:  # each plan is at most one of the strongest, none of which fits
        _try_pipelines(search, ordered, tops, tried)
    fitting = _ranked(search.fitting, base.plan)
    return SearchResult(budget_bytes, margin, base, fitting[:max_plans], search.estimated, search.skipped,
                        search.capped, time.perf_counter() - search.start, search.machine.device)


def _check_arguments(budget_bytes: int, margin: float, max_plans: int, max_estimates: int) -> None:
    """:func:`search_plans`'s budget and counts positive integers, its margin in [0, 1)."""
    from lightning_memkit.common.validation import check_int

    check_int(budget_bytes, "budget_bytes", minimum=1, owner="search_plans")
    check_int(max_plans, "max_plans", minimum=1, owner="search_plans")
    check_int(max_estimates, "max_estimates", minimum=1, owner="search_plans")
    if not 0 <= margin < 1:
        raise ValueError(f"search_plans(margin=...) must be in [0, 1), got {margin!r}")


def _new_search(run: Run, budget_bytes: int, margin: float, max_estimates: int,
                progress: Callable[[str], None] | None, machine: MachineBalance | None,
                host_budget: int | None) -> _Search:
    """The state of a new search: its machine, its progress line, and its tests of an estimate against the budget."""
    host_free = host_budget if host_budget is not None else free_device_memory("cpu")

    def device_fits(est: Any) -> bool:
        return _within(est, budget_bytes, margin)

    def fits(est: Any) -> bool:
        return _fits(est, run, budget_bytes, margin, host_free)

    return _Search(run, machine or run.machine(), fits,
                   progress or (lambda _line: None), max_estimates, device_fits)


def _try_tops(search: _Search, tops: list[Plan], ordered: list[Plan],
              base: tuple[PlanResult, StepCost]) -> list[tuple[Plan, tuple[PlanResult, StepCost] | None]]:
    """Each strongest plan and what trying it gave (``base``: the run as given's); where one keeps more than the
    host memory holds, the strongest keeping nothing there too."""
    run = search.run
    tried = [(top, base if top == run.base else search.try_plan(top)) for top in tops]
    if any(top in search.host_failed for top in tops):  # the strongest keep more than the host memory holds
        light = _host_free_tops(ordered, tops)
        search.queue = [*light, *(p for p in search.queue if p not in light)]
        tried += [(top, search.try_plan(top)) for top in light]
    return tried


def _open_tops(search: _Search, tried: list[tuple[Plan, tuple[PlanResult, StepCost] | None]],
               ) -> list[tuple[Plan, tuple[PlanResult, StepCost] | None]]:
    """The strongest plans tried below which a plan may fit, those within the host memory first."""
    # None: ruled out by a fitting base (only adds work) or the limit; over the host memory only: weaker may fit
    return sorted(((top, found) for top, found in tried
                   if found is None or found[0].fits or top in search.host_failed),
                  key=lambda t: t[0] in search.host_failed)


def _try_rest(search: _Search, top: Plan, ordered: list[Plan], tops: list[Plan], probe: bool) -> None:
    """Every plan but the strongest, least added work first; where ``probe``, the probes of ``top`` before them."""
    probes = _probes(top, ordered) if probe else []
    rest = [p for p in ordered if p not in tops and p not in probes]
    search.queue = [*probes, *rest]
    for plan in [*probes, *rest]:
        search.try_plan(plan)


def _try_pipelines(search: _Search, ordered: list[Plan], tops: list[Plan],
                   tried: list[tuple[Plan, tuple[PlanResult, StepCost] | None]]) -> None:
    """No strongest plan fits: the single-device plans counted as skipped, the run's pipeline plans tried until one
    fits."""
    run = search.run
    search.skipped += len(ordered) - sum(top != run.base for top in tops)
    search.queue = list(run.pipelines())
    for plan in list(search.queue):
        if (found := search.try_plan(plan, tried[0][1][1])) is not None and found[0].fits:
            break
