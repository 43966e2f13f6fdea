"""``memkit estimate``: from an HF config.json or a memkit config, table or JSON; bad arguments named."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_memkit.cli import ConfigError, main
from lightning_memkit.demo.hf_models import tiny_hf_config
from lightning_memkit.estimate_cli import estimate_from_hf_config

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def tiny_moe_json(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(tiny_hf_config("qwen3_moe").to_json_string())
    return path


def test_hf_config_json_and_table(tiny_moe_json: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["estimate", "--hf-config", str(tiny_moe_json), "--seq-len", "16", "--batch-size", "2", "--fused-loss"]
    main([*args, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["peak_bytes"] == max(p["peak_bytes"] for p in data["phases"][1:]) > 0
    assert 0 <= data["phases"][0]["weights"] - 4 * data["parameters"] < 1024  # float32 weights + rotary buffers
    assert [p["phase"] for p in data["phases"]] == ["load", "forward", "backward", "optimizer step"]
    assert any("uniform expert balance" in a for a in data["assumptions"])
    assert "fused_linear_cross_entropy_inside" in data["features"]
    main(args)
    out = capsys.readouterr().out
    assert "optimizer step" in out and f"({data['peak_bytes']:,} B)" in out  # the same estimate, as a table


@pytest.mark.slow
def test_features_lower_the_peak(tiny_moe_json: Path) -> None:
    plain = estimate_from_hf_config(tiny_moe_json, seq_len=64, batch_size=4)
    both = estimate_from_hf_config(tiny_moe_json, seq_len=64, batch_size=4, activation_checkpointing=True,
                                   fused_loss=True, precision="bf16-true", optimizer="sgd")
    assert both.peak_bytes < plain.peak_bytes / 2
    assert both.phases[2].loss_logits < plain.phases[2].loss_logits


def test_pipeline_matches_the_strategy_planning_on_real_tensors(tmp_path: Path) -> None:
    """The fake-tensor measurement gives memkit_pipeline's cost model the same layer costs as real tensors."""
    import torch
    import transformers

    from lightning_memkit.estimate_cli import estimate_hf_pipeline
    from lightning_memkit.hf.pipeline_stages import causal_lm_stages
    from lightning_memkit.pipeline import partition_layers
    from lightning_memkit.pipeline.runtime import measure_pipeline_costs

    config = tiny_hf_config("qwen3_moe", num_layers=4)
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string())
    est = estimate_hf_pipeline(path, 2, microbatches=4, seq_len=32, batch_size=8)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    stages = causal_lm_stages(model)
    inputs, target = stages.inputs({"input_ids": torch.randint(0, 256, (2, 32)),
                                    "labels": torch.randint(0, 256, (2, 32))})
    costs = measure_pipeline_costs(list(stages.layers), inputs, target, loss_fn=stages.loss,
                                   optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    real = partition_layers(costs, 2, schedule="1f1b", microbatches=4)
    assert est.partition.sizes == real.sizes
    assert est.partition.predicted_peak_bytes == real.predicted_peak_bytes
    assert json.loads(est.to_json())["peak_bytes"] == max(real.predicted_peak_bytes)


@pytest.mark.parametrize("args, message", [
    ([], "exactly one of --config"),
    (["--hf-config", "x.json", "--config", "y.yaml"], "exactly one of --config"),
    (["--hf-config", "missing.json"], "no such file"),
    (["--hf-config", "x.json", "--precision", "fp8"], "--precision"),
    (["--hf-config", "x.json", "--optimizer", "lion"], "--optimizer"),
    (["--hf-config", "x.json", "--seq-len", "0"], "--seq-len"),
    (["--hf-config", "x.json", "--plugin", "nf4"], "--plugin: 'nf4' is not estimated; allowed: nf4-lora"),
    (["--hf-config", "x.json", "--plugin", "int8-lora", "--precision", "bf16-true"],
     "--plugin int8-lora with --precision bf16-true"),
    (["--hf-config", "x.json", "--lora-rank", "4"], "--lora-rank: only with --plugin"),
    (["--hf-config", "x.json", "--plugin", "nf4-lora", "--lora-rank", "0"], "--lora-rank: must be an int >= 1"),
    (["--hf-config", "x.json", "--activation-checkpointing", "partial"], "--activation-checkpointing: 'partial'"),
    (["--hf-config", "x.json", "--budget", "0GiB"], "--budget: '0GiB' is not a positive size"),
    (["--hf-config", "x.json", "--budget", "lots"], "--budget"),
    (["--hf-config", "x.json", "--budget", "24XB"], "--budget"),
    (["--hf-config", "x.json", "--margin", "0.1"], "--margin: only with --budget"),
    (["--hf-config", "x.json", "--budget", "1GiB", "--margin", "1.5"], "--margin: must be in"),
    (["--hf-config", "x.json", "--budget", "1GiB", "--max-plans", "0"], "--max-plans"),
    (["--hf-config", "x.json", "--budget", "1GiB", "--pipeline", "2"], "--budget and --pipeline"),
    (["--hf-config", "x.json", "--budget", "1GiB", "--max-estimates", "1"], "--max-estimates: must be >= 2"),
    (["--hf-config", "x.json", "--max-estimates", "5"], "--max-estimates: only with --budget"),
    (["--hf-config", "x.json", "--plugin", "nf4-lora", "--pipeline", "2"], "--pipeline with --plugin"),
    (["--hf-config", "x.json", "--pipeline", "1"], "--pipeline: must be >= 2"),
    (["--hf-config", "x.json", "--microbatches", "2"], "--microbatches: only with --pipeline"),
    (["--hf-config", "x.json", "--pipeline", "2", "--batch-size", "3"], "--microbatches: must be >= 1 and divide"),
    (["--config", "c.yaml", "--pipeline", "2"], "--pipeline: only with --hf-config"),
    (["--config", "c.yaml", "--seq-len", "512", "--fused-loss"], "--seq-len, --fused-loss: with --config"),
])
def test_bad_arguments(args: list[str], message: str) -> None:
    from lightning_memkit.estimate_cli import main as estimate_main

    with pytest.raises(ConfigError, match=message):
        estimate_main(args)


def test_config_without_model_type(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ConfigError, match="model_type"):
        estimate_from_hf_config(path)


@pytest.mark.slow
def test_memkit_config(capsys: pytest.CaptureFixture) -> None:
    main(["estimate", "--config", str(REPO / "examples/configs/tiny_lm.yaml"), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["peak_bytes"] > 0 and data["features"][0].startswith("activation checkpointing")


@pytest.mark.slow
def test_gpt_oss_20b_answers_in_under_a_minute() -> None:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "lightning_memkit.cli", "estimate", "--hf-config",
                          "examples/hf_configs/gpt_oss_20b.json", "--seq-len", "4096", "--precision", "bf16-true",
                          "--json"], cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    seconds = time.perf_counter() - start
    data = json.loads(out.stdout)
    assert 20.5e9 < data["parameters"] < 21.5e9  # the published ~21B
    assert 0 <= data["phases"][0]["weights"] - 2 * data["parameters"] < 2**20  # bf16 weights + rotary buffers
    assert seconds < 60, seconds
