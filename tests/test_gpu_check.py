"""``make gpu-check`` on CPU: the dry run, what the steps cover, the resumable runner, the wheels, the results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks import gpu_check, gpu_wheels
from benchmarks.gpu_check import Step

ROOT = Path(__file__).resolve().parents[1]


def test_make_gpu_check_dry_run_lists_every_step_with_its_time_and_the_total():
    if shutil.which("make") is None:
        pytest.skip("needs make")
    for quick, budget in (("", gpu_check.FULL_BUDGET_S), ("QUICK=1", gpu_check.QUICK_BUDGET_S)):
        done = subprocess.run(["make", "-s", "gpu-check", "DRY_RUN=1", f"GPU_PYTHON={sys.executable}",
                               *filter(None, [quick])], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.strip().splitlines()
        steps = gpu_check.plan(bool(quick))
        assert lines[0].startswith(f"make gpu-check{' QUICK=1' if quick else ''}: {len(steps)} steps")
        for step, line in zip(steps, lines[1:-1]):
            assert line.split()[:3] == [step.name, str(step.expected_s), "s"]
        total = sum(s.expected_s for s in steps)
        assert lines[-1].split()[:3] == ["total", str(total), "s"] and f"budget {budget} s" in lines[-1]
    assert gpu_check.dry_run(True, lambda _: None) <= gpu_check.QUICK_BUDGET_S


def test_every_test_folder_and_file_is_in_exactly_one_pytest_step():
    """A CUDA test added anywhere under tests/ is run by the check: no folder or top-level file is left out."""
    covered = [p for s in gpu_check.STEPS if "pytest" in s.argv for p in s.argv if p.startswith("tests/")]
    entries = sorted(f"tests/{p.name}" for p in (ROOT / "tests").iterdir()
                     if (p.is_dir() and any(p.glob("test_*.py"))) or p.name.startswith("test_"))
    assert sorted(covered) == entries


def test_every_benchmark_runs_on_cuda_or_says_why_not():
    names = {p.stem.removeprefix("bench_") for p in (ROOT / "benchmarks").glob("bench_*.py")}
    steps = {s.name.removeprefix("bench-") for s in gpu_check.STEPS if s.name.startswith("bench-")}
    assert steps.isdisjoint(gpu_check.CPU_ONLY_BENCHMARKS) and steps | set(gpu_check.CPU_ONLY_BENCHMARKS) == names
    quick = [s.name for s in gpu_check.plan(True)]
    assert {"environment", "bench-cross_entropy", "bench-stage_boundary", "render"} <= set(quick)


def _py(code: str) -> tuple[str, ...]:
    return ("{python}", "-c", code)


def test_the_runner_keeps_what_finished_skips_it_on_a_rerun_and_names_what_it_left_out(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "REPO", tmp_path)
    monkeypatch.setattr(gpu_check, "PEERS", {"json": "json"})  # a peer that imports, quickly
    count = tmp_path / "count"
    steps = [
        Step("a", _py(f"import pathlib; p = pathlib.Path({str(count)!r}); p.write_text(str(int(p.read_text() or 0) "
                      "+ 1) if p.exists() else '1'); pathlib.Path('out-a.json').write_text('{}')"), 1, True,
             writes=("out-a.json",)),
        Step("b", _py("import sys; print('boom'); sys.exit(3)"), 1, True),
        Step("c", _py("pass"), 1, True, needs=("no_such_peer_module",)),
        Step("d", _py("pass"), 10_000, True),
    ]
    out, state = tmp_path / "out", tmp_path / "state"
    run = gpu_check.check(True, out, None, state_dir=state, budget_s=100, steps=steps)
    s = run.state["steps"]
    assert s["a"]["status"] == "passed" and s["b"]["status"] == "failed" and "exit 3" in s["b"]["detail"]
    assert s["c"]["status"] == "skipped" and "needs no_such_peer_module: ModuleNotFoundError" in s["c"]["detail"]
    assert "d" not in s  # would overrun the budget: not started, and not marked finished
    assert (state / "logs" / "b.log").read_text().strip() == "boom"
    summary = (state / "summary.md").read_text()
    assert "| b | failed |" in summary and "| c | skipped |" in summary and "peers: json ok" in summary
    # what a step wrote, the state, the summary and the logs are in `out` as they come (paths kept)
    assert (out / "out-a.json").is_file() and (out / "state" / "summary.md").read_text() == summary
    assert json.loads((out / "state" / "state.json").read_text())["steps"] == s
    assert (out / "state" / "logs" / "b.log").is_file()
    # a rerun skips what finished; --redo runs one again
    gpu_check.check(True, out, None, state_dir=state, budget_s=100, steps=steps)
    assert count.read_text() == "1"
    gpu_check.check(True, out, None, redo=["a"], state_dir=state, budget_s=100, steps=steps)
    assert count.read_text() == "2"


def test_a_step_past_the_budget_is_killed_and_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "REPO", tmp_path)
    monkeypatch.setattr(gpu_check, "_GRACE_S", 0.5)
    monkeypatch.setattr(gpu_check, "PEERS", {})  # no peer imports to time: the budget is the step's alone
    steps = [Step("slow", _py("import time; time.sleep(60)"), 1, True)]
    run = gpu_check.check(True, None, None, state_dir=tmp_path / "s", budget_s=2, steps=steps)
    assert run.state["steps"]["slow"]["status"] == "timeout" and run.state["steps"]["slow"]["seconds"] < 10


def _wheel(directory: Path, name: str, body: str) -> Path:
    """A minimal pure-Python wheel holding module ``name``."""
    dist = f"{name}-0.1.dist-info"
    path = directory / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", body)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


@pytest.mark.parametrize("with_pip", [True, False])
def test_wheels_install_offline_and_peers_are_reported_by_name(tmp_path, monkeypatch, with_pip):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "tinypeer", "VALUE = 7\n")
    if not with_pip:  # a Python without pip: the wheel is unpacked
        real = subprocess.run
        monkeypatch.setattr(gpu_check.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1)
                            if cmd[1:3] == ["-m", "pip"] else real(cmd, **kw))
    env, installed = gpu_check._environment(sys.executable, wheels)
    assert installed == ["tinypeer"]
    found = gpu_check.importable(sys.executable, env, ["tinypeer", "no_such_peer_module"])
    assert found == {"tinypeer": None, "no_such_peer_module": "ModuleNotFoundError: No module named "
                                                             "'no_such_peer_module'"}
    site = Path(env["PYTHONPATH"].split(os.pathsep)[0])
    assert (site / "tinypeer" / "__init__.py").read_text() == "VALUE = 7\n"


def test_gpu_wheels_fit_in_the_limit_dropping_the_last_wanted_first():
    sizes = {"cut-cross-entropy": 30_000, "liger-kernel": 1_000_000, "bitsandbytes": 45 * 2**20}
    assert gpu_wheels.fit(sizes, 40 * 2**20) == (["cut-cross-entropy", "liger-kernel"], ["bitsandbytes"])
    assert gpu_wheels.WANTED[-1] == "bitsandbytes"  # the big one is the one to go
    assert gpu_wheels.pinned("pytest").startswith("pytest==")
    assert gpu_wheels.repo_bytes() < gpu_wheels.LIMIT_BYTES
