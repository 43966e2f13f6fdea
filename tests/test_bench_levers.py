"""``benchmarks/bench_levers.py`` runs end to end (one family, three levers, a model of some 30k parameters: the byte
data needs a vocabulary of 256) and its result file renders like every benchmark's; the figures themselves come from
``python -m benchmarks.run``."""

import json
import sys
from pathlib import Path

import pytest

REPO = str(Path(__file__).resolve().parents[1])  # holds the `benchmarks` package
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from benchmarks import bench_levers, run  # noqa: E402

SMOKE = bench_levers.Shape(hidden=32, layers=2, vocab=256, batch=2, seq=16, steps=2, timed_steps=3, skip=2)


@pytest.mark.slow  # 20 s: the fast suite runs the levers through their own tests
def test_levers_benchmark_smoke(tmp_path, monkeypatch):
    levers = {name: make for name, make in bench_levers.LEVERS}
    kept = ("none (baseline)", "activation offload", "offload optimizer")
    monkeypatch.setattr(bench_levers, "LEVERS", tuple((name, levers[name]) for name in kept))
    monkeypatch.setattr(bench_levers, "FAMILIES", ("llama",))
    monkeypatch.setattr(bench_levers, "QUICK", SMOKE)
    monkeypatch.setattr(bench_levers, "WIDE_QUICK", SMOKE)  # the parameter-heavy case: the same tiny shape here
    data = json.loads(run.run_one("levers", "cpu", True, tmp_path).read_text())
    assert data["command"] == "python -m benchmarks.run --only levers --device cpu --quick"
    assert len(data["entries"]) == 4  # the family's two entries, and the parameter-heavy shape's two
    alone, budget = data["entries"][:2]
    rows = {r["impl"]: r for r in alone["rows"]}
    assert list(rows) == list(kept)
    base = rows["none (baseline)"]
    assert base["cut B"] == 0 and base["host peak B"] == 0 and base["step time vs baseline"] == 1.0
    for name in kept[1:]:  # each moves bytes to host memory, counted apart, with the baseline's losses
        r = rows[name]
        assert r["device peak B"] + r["cut B"] == base["device peak B"] and r["host peak B"] > 0
        assert r["losses bitwise"] == "yes" and r["step time vs baseline"] > 0
    assert [r["impl"] for r in budget["rows"]][1:] == [
        f"MemoryBudget default allow ({', '.join(bench_levers.DEFAULT_ALLOW)})",
        "MemoryBudget allow=['recompute', 'fused_loss', 'micro_batch'] (the levers before)"]
    for r in budget["rows"][1:]:
        assert r["budget B"] == int(base["device peak B"] * bench_levers.FRACTION)
        assert r["fits"] in ("yes", "NOT met", "NOT met (NoPlanFits)", "NOT met (failed during the run)") and r["plan"]
    assert budget["met"] == (budget["rows"][1]["fits"] == "yes")  # the goal is the default allow's
    assert "## levers (cpu)" in run.render(tmp_path) and "| offload optimizer |" in run.render(tmp_path)
