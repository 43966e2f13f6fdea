"""``benchmarks/bench_plans_8b.py`` and ``bench_recipes.py`` run end to end on a tiny Llama config (one lever
allowed, a budget only the recomputed step meets) and their entries render with the first plan's YAML; a recipe
without its planning command is refused; the figures come from ``python -m benchmarks.run``."""

import json
import sys
from pathlib import Path

import pytest

REPO = str(Path(__file__).resolve().parents[1])  # holds the `benchmarks` package
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from benchmarks import bench_plans_8b, bench_recipes, run  # noqa: E402
from lightning_memkit.demo.hf_models import tiny_hf_config  # noqa: E402


@pytest.mark.slow  # plan_entry also runs in the fast suite through the recipes smoke test below
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


@pytest.mark.slow
def test_recipes_benchmark_runs_the_commands_a_recipe_header_names(tmp_path, monkeypatch):
    """Every backticked command of the header (not the YAML below it) becomes an entry labelled by the recipe's file;
    the one run here is a budget no plan fits (the plans_8b smoke above renders a plan that fits)."""
    config = tmp_path / "llama.json"
    config.write_text(tiny_hf_config("llama", vocab_size=1000, num_layers=2).to_json_string())
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    tight = f"--hf-config {config} --seq-len 256 --batch-size 2 --allow recompute --budget 1KiB"
    (recipes / "tiny.yaml").write_text(
        f"# Planned for 10 MiB: `memkit estimate --hf-config {config} --seq-len 256\n# --budget 10MiB` predicts ...\n"
        "model: {}\n# `memkit estimate --budget 2MiB` is not in the header\n")
    monkeypatch.setattr(bench_recipes, "RECIPES", recipes)
    assert bench_recipes.planned_for(recipes / "tiny.yaml") == [
        ("--hf-config", str(config), "--seq-len", "256", "--budget", "10MiB")]
    (recipes / "tiny.yaml").write_text(f"# Within 1 KiB: `memkit estimate {tight}` finds no plan that fits.\n")
    data = json.loads(run.run_one("recipes", "cpu", False, tmp_path).read_text())
    (entry,) = data["entries"]
    assert entry["case"].startswith(f"tiny.yaml (memkit estimate {tight})") and entry["met"] is False
    (recipes / "tiny.yaml").write_text("# a recipe that does not say how it was planned\nmodel: {}\n")
    with pytest.raises(ValueError, match="tiny.yaml: its header must name the `memkit estimate"):
        bench_recipes.run()
