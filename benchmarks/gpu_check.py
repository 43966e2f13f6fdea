"""``make gpu-check``: every CUDA test, CUDA doc block and CUDA benchmark entry, in one resumable run.

Made for a GPU lent for minutes, with no network: it runs on that machine's own Python as it is (no virtual
environment), puts the wheels ``make gpu-wheels`` prepared (the peers Cut Cross-Entropy and Liger-Kernel,
jsonargparse for the CLI, bitsandbytes) into a temporary folder on ``PYTHONPATH``, then runs the steps of
:data:`STEPS` in order, each a subprocess with its own log and time limit. After every step the state
(``runs/gpu-check/state.json``), a summary (``runs/gpu-check/summary.md``) and what the step wrote
(``benchmarks/results/*-cuda.json``, the regenerated pages) are saved, and copied to ``--out`` when given: a
run cut short keeps what finished, and a rerun skips every finished step (``--redo NAME`` runs one again).
A step whose time would overrun ``--budget-s`` is not started; a step that needs a package that is missing is
skipped, naming it.

    python -m benchmarks.gpu_check --dry-run        # the steps, expected times and totals (no GPU needed)
    python -m benchmarks.gpu_check --quick          # the subset marked quick
    python -m benchmarks.gpu_check --out "$OUT"     # copy the results there as they come

Standard library only: the dry run works on any Python, and nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STATE_DIR = REPO / "runs" / "gpu-check"
FULL_BUDGET_S = 480
QUICK_BUDGET_S = 240
PEERS = {"cut_cross_entropy": "Cut Cross-Entropy", "liger_kernel": "Liger-Kernel", "bitsandbytes": "bitsandbytes",
         "jsonargparse": "jsonargparse"}
_PAGES = ("docs/*.md",)
_GRACE_S = 30.0  # a step may run this long past the budget before it is killed
# benchmarks with nothing to measure on a GPU (each refuses --device cuda or measures host memory only)
CPU_ONLY_BENCHMARKS = {"budget": "the device limit is simulated with LivePeak on CPU",
                       "hf_load": "host memory of a checkpoint load", "hf_qlora": "CPU only (bitsandbytes on CPU)",
                       "levers": "device and host bytes counted apart by LivePeak on CPU; the budget's limit "
                                 "simulated there, as in budget",
                       "peft_qlora": "CPU only (bitsandbytes on CPU)", "pipeline_mesh": "gloo processes on CPU",
                       "plan_time": "planning time on this machine's cores: the estimates run on fake tensors on "
                                    "the CPU whatever the device",
                       "plans_8b": "estimates made on this machine for a CUDA device; no step runs",
                       "recipes": "estimates made on this machine for a CUDA device; no step runs",
                       "sharding": "estimates for CUDA devices made here, and gloo ranks on CPU (one GPU is lent)",
                       "long_context": "estimates made on this machine for a CUDA device, and tiny models measured "
                                       "with LivePeak on CPU"}


@dataclass(frozen=True)
class Step:
    """One command of the check: ``argv`` (``{python}`` is the running interpreter), its expected seconds on one
    H100, whether the quick subset has it, the modules it needs, and the files it writes (globs)."""

    name: str
    argv: tuple[str, ...]
    expected_s: int
    quick: bool
    needs: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    always: bool = False  # runs on every run, past the budget too (the device check, the page rendering)


def _pytest(name: str, paths: Sequence[str], expected_s: int, quick: bool, needs: tuple[str, ...] = ()) -> Step:
    junit = f"runs/gpu-check/{name}.xml"
    return Step(name, ("{python}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "-o",
                       "addopts=", "--junitxml", junit, *paths), expected_s, quick, needs, (junit,))


def _bench(name: str, expected_s: int, quick: bool, needs: tuple[str, ...] = ()) -> Step:
    return Step(f"bench-{name}", ("{python}", "-m", "benchmarks.run", "--only", name, "--device", "cuda"),
                expected_s, quick, needs, (f"benchmarks/results/{name}-cuda.json", *_PAGES))


# Every test folder and top-level test file is in exactly one pytest step (a test checks it); expected times are
# estimates until a run on the GPU measures them (runs/gpu-check/summary.md has the measured ones).
STEPS: tuple[Step, ...] = (
    Step("environment", ("{python}", "-c", "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; "
                         "print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'CUDA', torch.version.cuda, "
                         "'triton', triton.__version__)"), 10, True, always=True),
    _pytest("tests-ops", ["tests/ops", "tests/loading"], 45, True),
    _pytest("tests-memory", ["tests/measure", "tests/release", "tests/recompute", "tests/callbacks", "tests/demo",
                             "tests/common", "tests/offload", "tests/optim"],
            45, True),
    _pytest("tests-docs", ["tests/test_docs.py", "tests/test_demo_doc.py", "tests/test_bench_docs.py",
                           "tests/test_bench_levers.py", "tests/test_bench_plans_8b.py"], 25, True),
    _pytest("tests-models", ["tests/hf", "tests/plugins", "tests/estimate", "tests/finetune"], 50, False),
    _pytest("tests-pipeline", ["tests/pipeline", "tests/sharding", "tests/strategies", "tests/reliability", "tests/cli",
                               "tests/test_architecture.py", "tests/test_gpu_check.py", "tests/test_import.py",
                               "tests/test_zygote.py", "tests/test_machine_independence.py"], 45,
            False,
            ("jsonargparse",)),
    _bench("cross_entropy", 75, True),
    _bench("stage_boundary", 20, True),
    _bench("estimate", 70, False),
    _bench("activation_checkpointing", 35, False),
    _bench("phase_release", 20, False),
    _bench("live_peak", 10, False),
    _bench("overhead", 10, False),
    _bench("step_time", 30, False),
    _bench("mxfp4", 15, False),
    _bench("nosave_bnb", 15, False, ("bitsandbytes",)),
    _bench("pipeline_partition", 15, False),
    Step("compare-cuda", ("{python}", "-m", "lightning_memkit.cli", "compare", "--config",
                          "examples/configs/tiny_lm.yaml", "--trainer.accelerator", "gpu", "--trainer.devices", "1",
                          "--out-dir", "runs/gpu-check/compare"), 40, False, ("jsonargparse",),
         ("runs/gpu-check/compare/*",)),
    Step("render", ("{python}", "-m", "benchmarks.run", "--render-only"), 5, True, (), ("docs/*.md",), always=True),
)


def plan(quick: bool) -> list[Step]:
    """The steps of a full run, or of the quick subset."""
    return [s for s in STEPS if s.quick or not quick]


def dry_run(quick: bool, write: Callable[[str], None] = print) -> int:
    """Write every step with its expected time, and the total; return the total in seconds."""
    steps = plan(quick)
    budget = QUICK_BUDGET_S if quick else FULL_BUDGET_S
    write(f"make gpu-check{' QUICK=1' if quick else ''}: {len(steps)} steps, times expected on one H100")
    for s in steps:
        needs = f"  (needs {', '.join(s.needs)})" if s.needs else ""
        write(f"  {s.name:<32} {s.expected_s:>4} s  {' '.join(s.argv).replace('{python}', 'python')}{needs}")
    total = sum(s.expected_s for s in steps)
    write(f"  {'total':<32} {total:>4} s  (budget {budget} s; the GPU machine's start-up is not counted)")
    return total


# -- the wheels --------------------------------------------------------------------------------------------
def install_wheels(wheels: Path, target: Path, python: str) -> list[str]:
    """Install every wheel of ``wheels`` into ``target`` without the network (pip ``--no-index``, or by
    unpacking where that Python has no pip); the names installed."""
    files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not files:
        return []
    target.mkdir(parents=True, exist_ok=True)
    pip = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target)]
    if subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode == 0:
        subprocess.run([*pip, *map(str, files)], check=True)
    else:
        for f in files:
            _unpack(f, target)
    return [f.name.split("-")[0] for f in files]


def _unpack(wheel: Path, target: Path) -> None:
    """A wheel is a zip: its files, with ``*.data/purelib`` and ``platlib`` moved to the top."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
    for data in target.glob("*.data"):
        for lib in ("purelib", "platlib"):
            for item in (data / lib).glob("*") if (data / lib).is_dir() else []:
                shutil.move(str(item), target / item.name)


def importable(python: str, env: dict[str, str], modules: Sequence[str]) -> dict[str, str | None]:
    """``{module: None}`` for each module that imports, else the one-line reason it does not."""
    out: dict[str, str | None] = {}
    for m in modules:
        done = subprocess.run([python, "-c", f"import {m}"], capture_output=True, text=True, env=env)
        lines = (done.stderr.strip().splitlines() or [""]) if done.returncode else None
        out[m] = None if lines is None else lines[-1][:200]
    return out


# -- the run -----------------------------------------------------------------------------------------------
class Run:
    """The state of one (possibly resumed) check: what finished, how long it took, what it wrote."""

    def __init__(self, state_dir: Path, out: Path | None, budget_s: float, redo: Sequence[str] = ()) -> None:
        self.dir, self.out, self.budget_s = state_dir, out, budget_s
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "logs").mkdir(exist_ok=True)
        self.file = self.dir / "state.json"
        self.state: dict = json.loads(self.file.read_text()) if self.file.is_file() else {"steps": {}}
        for name in redo:
            self.state["steps"].pop(name, None)
        self.start = time.monotonic()

    def finished(self, step: Step) -> bool:
        return self.state["steps"].get(step.name, {}).get("status") in ("passed", "failed", "timeout", "skipped")

    def record(self, step: Step, status: str, seconds: float = 0.0, detail: str = "") -> None:
        self.state["steps"][step.name] = {"status": status, "seconds": round(seconds, 1),
                                          "expected_s": step.expected_s, "detail": detail}
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2) + "\n")
        os.replace(tmp, self.file)
        self.write_summary()
        self.copy_out(step.writes)

    def write_summary(self) -> None:
        rows = [f"| {name} | {s['status']} | {s['seconds']} | {s['expected_s']} | {s['detail']} |"
                for name, s in self.state["steps"].items()]
        peers = self.state.get("peers", {})
        lines = [
            "# GPU check", "", f"device: {self.state.get('device', '?')}", "",
            "peers: " + (", ".join(f"{PEERS.get(m, m)} {'ok' if why is None else 'skipped (' + why + ')'}"
                                   for m, why in peers.items()) or "none checked"), "",
            "| step | status | seconds | expected | detail |", "| --- | --- | --- | --- | --- |", *rows, "",
        ]
        (self.dir / "summary.md").write_text("\n".join(lines))

    def copy_out(self, patterns: Sequence[str]) -> None:
        """Copy the state, summary, logs and the step's outputs to ``out`` (when given), keeping their paths."""
        if self.out is None:
            return
        files = [p for pattern in patterns for p in REPO.glob(pattern)]
        files += [self.file, self.dir / "summary.md", *sorted((self.dir / "logs").glob("*.log"))]
        for f in (f for f in files if f.is_file()):
            dest = self.out / f.relative_to(REPO)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest)

    def remaining(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)


def run_step(run: Run, step: Step, python: str, env: dict[str, str], missing: dict[str, str | None]) -> str:
    """Run ``step`` unless it finished before, needs a missing module or would overrun the budget; its status."""
    if run.finished(step) and not step.always:
        return "done before"
    absent = [m for m in step.needs if missing.get(m) is not None]
    if absent:
        run.record(step, "skipped", detail=f"needs {', '.join(absent)}: {'; '.join(str(missing[m]) for m in absent)}")
        return "skipped"
    if step.expected_s > run.remaining() and not step.always:
        return "not started (budget)"
    argv = [a.replace("{python}", python) for a in step.argv]
    limit = max(60.0, 3.0 * step.expected_s)
    limit = limit if step.always else min(limit, run.remaining() + _GRACE_S)
    log = run.dir / "logs" / f"{step.name}.log"
    began = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            run.record(step, "timeout", time.monotonic() - began, f"killed after {limit:.0f} s")
            return "timeout"
    status = "passed" if rc == 0 else "failed"
    run.record(step, status, time.monotonic() - began, "" if rc == 0 else f"exit {rc}, see logs/{step.name}.log")
    return status


def _environment(python: str, wheels: Path | None) -> tuple[dict[str, str], list[str]]:
    env = dict(os.environ)
    paths = [str(REPO)]
    installed: list[str] = []
    if wheels is not None:
        site = Path(tempfile.mkdtemp(prefix="memkit-gpu-site-"))
        installed = install_wheels(wheels, site, python)
        paths.insert(0, str(site))
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("MPLBACKEND", "Agg")
    return env, installed


def check(quick: bool, out: Path | None, wheels: Path | None, redo: Sequence[str] = (), python: str = sys.executable,
          state_dir: Path = STATE_DIR, budget_s: float | None = None, steps: Sequence[Step] | None = None) -> Run:
    """Run the check (see the module docstring); returns the run's state."""
    run = Run(state_dir, out, budget_s or (QUICK_BUDGET_S if quick else FULL_BUDGET_S), redo)
    env, installed = _environment(python, wheels)
    run.state["wheels"] = installed
    steps = plan(quick) if steps is None else steps
    run.state["peers"] = importable(python, env, list(PEERS))
    needed = sorted({m for s in steps for m in s.needs} - set(PEERS))
    missing = {**run.state["peers"], **importable(python, env, needed)}
    for step in steps:
        status = run_step(run, step, python, env, missing)
        print(f"gpu-check: {step.name}: {status} ({run.remaining():.0f} s of the budget left)", flush=True)
        if step.name == "environment":
            log = run.dir / "logs" / "environment.log"
            lines = log.read_text().strip().splitlines() if log.is_file() else []
            run.state["device"] = lines[-1] if lines else "?"
            if status != "passed":
                print("gpu-check: no usable CUDA device: stopping", flush=True)
                break
    run.write_summary()
    run.copy_out(())
    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="list the steps and their expected times")
    parser.add_argument("--quick", action="store_true", help=f"the quick subset (budget {QUICK_BUDGET_S} s)")
    parser.add_argument("--out", type=Path, default=None, help="copy results, logs and pages here as they come")
    parser.add_argument("--wheels", type=Path, default=None, help="the folder `make gpu-wheels` filled")
    parser.add_argument("--redo", action="append", default=[], help="run this finished step again (repeatable)")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds in all (default: 480, quick 240)")
    args = parser.parse_args(argv)
    known = {s.name for s in STEPS}
    unknown = [n for n in args.redo if n not in known]
    if unknown:
        parser.error(f"--redo {unknown[0]}: no such step; choose from {', '.join(sorted(known))}")
    if args.dry_run:
        dry_run(args.quick)
        return 0
    run = check(args.quick, args.out, args.wheels, args.redo, budget_s=args.budget_s)
    bad = [n for n, s in run.state["steps"].items() if s["status"] in ("failed", "timeout")]
    print((run.dir / "summary.md").read_text())
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
