"""The tests that plan pass whatever device balance the planner ranks with.

The plan search ranks the plans that fit by a step time model priced with the training device's balance, measured
on the machine that runs it (``lightning_memkit.measure.machine.probe_machine``); two plans close in predicted time
swap places from one machine to the next. So a test that asserts which plan is chosen, or a figure that follows
from the ranking (the rounding a plan's losses carry), pins the balance it ranks with (the ``pinned_machine``
fixture of ``tests/conftest.py``, or ``machine=`` given to ``search_plans`` / ``MemoryBudget``); any other test
that plans asserts only what holds on any machine (the plan fits, keeps the math, changes the fewest levers).

Here every test module that plans (its source names ``MemoryBudget``, ``search_plans``, ``--budget`` or a recipe
config) runs in a child pytest under each of two very different balances forced on the planner through
``MEMKIT_MACHINE``: a GEMM-bound device with fast memory and a fast link, and a memory-bound one with a slow host
link. A test that fails under either depends on the machine that runs it. The child runs those modules' default
tests (not the ``slow`` ones, which plan on pinned balances); the first test shows the check can fail. Slow (CI
runs it): ``MEMKIT_RUN_SLOW=1 pytest tests/test_machine_independence.py`` on a developer's machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLANS = re.compile(r"MemoryBudget|search_plans|--budget|recipes/")
BALANCES = {
    "gemm-bound": {"gemm_flops": {"float32": 1e9, "bfloat16": 1e9, "float16": 1e9}, "memory_bytes_per_s": 1e13,
                   "link_bytes_per_s": 1e13},
    "memory-bound, slow link": {"gemm_flops": {"float32": 1e14, "bfloat16": 4e14, "float16": 4e14},
                                "memory_bytes_per_s": 1e9, "link_bytes_per_s": 1e7, "host_memory_bytes_per_s": 1e9},
}
CHILD_TIMEOUT_S = 1500

pytestmark = pytest.mark.slow


def planning_modules() -> list[Path]:
    """The test modules that plan, found by what their source names (a new one is included as it is written)."""
    here = Path(__file__).resolve()
    return sorted(p for p in (ROOT / "tests").rglob("test_*.py") if p != here and PLANS.search(p.read_text()))


def run_forced(paths: list[Path], balance: dict, cwd: Path = ROOT) -> tuple[int, list[str], str]:
    """``pytest paths`` in a child process with ``balance`` forced on the planner (``MEMKIT_MACHINE``), slow tests
    skipped: its exit code, the ids of the tests that failed, the tail of its output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "MEMKIT_RUN_SLOW"))}
    env.update(MEMKIT_MACHINE=json.dumps({"device": "forced", **balance}), PYTHONDONTWRITEBYTECODE="")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-o", "addopts=", "-rf", *map(str, paths)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=CHILD_TIMEOUT_S)
    out = proc.stdout + proc.stderr
    return proc.returncode, re.findall(r"^FAILED (\S+)", out, re.M), out[-3000:]


CANARY = '''
from dataclasses import dataclass

from lightning_memkit.estimate.levers import Plan
from lightning_memkit.estimate.plans import search_plans
from lightning_memkit.estimate.runs import LeverRun


@dataclass
class Estimate:
    peak_bytes: int
    step_flops: int
    step_bytes: int


class Run(LeverRun):
    """The run as given does not fit; recomputation costs FLOPs, the fused loss bytes: the balance decides."""

    base = Plan(recompute=None, fused_loss=False, micro_batch=8)
    COSTS = {(None, False): (10, 1000, 100), ("full", False): (1, 2000, 100), (None, True): (1, 1000, 1000),
             ("full", True): (1, 2000, 1000)}

    def axes(self):
        return [Plan(recompute=r, fused_loss=f, micro_batch=8) for r, f in self.COSTS]

    def estimate(self, plan):
        return Estimate(*self.COSTS[plan["recompute"], plan["fused_loss"]])

    def fragment(self, plan):
        return {}

    def notes(self, plan):
        return []


def winner():
    return search_plans(Run(), 2, margin=0.0).fitting[0].plan.describe(Run.base)


def test_asserts_the_plan_its_machine_ranks_first():
    assert winner() == "full activation checkpointing"


def test_asserts_the_plan_on_a_pinned_balance(monkeypatch):
    monkeypatch.setenv("MEMKIT_MACHINE", "h100")
    assert winner() == "full activation checkpointing"


def test_asserts_only_what_any_machine_gives():
    assert winner() in ("full activation checkpointing", "fused loss")
'''


def test_the_check_finds_a_test_that_asserts_a_plan_without_pinning_its_balance(tmp_path: Path) -> None:
    """A made-up run whose winner the balance decides: the unpinned assertion fails under one forced balance, the
    pinned one and the one that asserts only what any machine gives pass under both."""
    canary = tmp_path / "test_canary.py"
    canary.write_text(CANARY)
    failed = {}
    for name, balance in BALANCES.items():
        code, failed[name], out = run_forced([canary], balance, cwd=tmp_path)
        assert code in (0, 1), out
    assert sorted(failed.values()) == [[], ["test_canary.py::test_asserts_the_plan_its_machine_ranks_first"]], failed


def test_the_planning_modules_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in planning_modules()}
    assert {"tests/callbacks/test_memory_budget.py", "tests/estimate/test_plans.py", "tests/hf/test_peft.py",
            "tests/cli/test_cli_estimate.py", "tests/finetune/test_recipes.py"} <= names


@pytest.mark.timeout(CHILD_TIMEOUT_S + 60)  # the child runs every planning module's default tests (minutes)
@pytest.mark.parametrize("name", list(BALANCES))
def test_the_tests_that_plan_pass_under_a_forced_balance(name: str) -> None:
    code, failed, out = run_forced(planning_modules(), BALANCES[name])
    assert code == 0 and not failed, f"under a {name} balance these tests change their answer: {failed}\n{out}"
