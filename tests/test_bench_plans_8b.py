"""``benchmarks/bench_plans_8b.py`` runs end to end on a tiny Llama config (one lever allowed, a budget only the
recomputed step meets) and its entry renders with the first plan's YAML; the figures come from
``python -m benchmarks.run``."""

import json
import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])  # holds the `benchmarks` package
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from benchmarks import bench_plans_8b, run  # noqa: E402
from lightning_memkit.demo.hf_models import tiny_hf_config  # noqa: E402


def test_plans_benchmark_smoke(tmp_path, monkeypatch):
    config = tmp_path / "llama.json"
    config.write_text(tiny_hf_config("llama", vocab_size=1000, num_layers=2).to_json_string())
    flags = ("--seq-len", "256", "--batch-size", "2", "--allow", "recompute", "--budget", "10MiB")
    monkeypatch.setattr(bench_plans_8b, "CONFIG", str(config))
    monkeypatch.setattr(bench_plans_8b, "CASES", (("tiny", flags),))
    data = json.loads(run.run_one("plans_8b", "cpu", True, tmp_path).read_text())
    (entry,) = data["entries"]
    rows = {r["impl"]: r for r in entry["rows"]}
    assert rows["the run as given"]["device peak GiB"] > 10 / 1024
    assert "activation checkpointing" in rows["plan 1"]["plan"] and rows["plan 1"]["devices"] == 1
    assert entry["met"] is True and "ActivationCheckpointing" in entry["text"]
    assert "```\n#" in "\n".join(run._entry_lines(entry, "t"))
