"""``memkit estimate``: from an HF config.json or a memkit config, table or JSON; bad arguments named."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_memkit.cli.main import main
from lightning_memkit.config.errors import ConfigError
from lightning_memkit.demo.hf_models import tiny_hf_config
from lightning_memkit.estimate.hf import estimate_from_hf_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_moe_json(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(tiny_hf_config("qwen3_moe").to_json_string())
    return path


def test_hf_config_json_and_table(tiny_moe_json: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["estimate", "--hf-config", str(tiny_moe_json), "--seq-len", "16", "--batch-size", "2", "--fused-loss"]
    main([*args, "--json"])
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert err == ""  # a complete config: no warning
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

    from lightning_memkit.estimate.hf import estimate_hf_pipeline
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
    (["--hf-config", "x.json", "--budget", "1GiB", "--margin", "1.5"], "--margin=1.5: must be a finite number >= 0"),
    (["--hf-config", "x.json", "--budget", "1GiB", "--max-plans", "0"], "--max-plans"),
    (["--hf-config", "x.json", "--budget", "1GiB", "--pipeline", "2"], "--budget and --pipeline"),
    (["--hf-config", "x.json", "--budget", "1GiB", "--max-estimates", "1"], "--max-estimates=1: must be an int >= 2"),
    (["--hf-config", "x.json", "--max-estimates", "5"], "--max-estimates: only with --budget"),
    (["--hf-config", "x.json", "--machine", "h100"], "--machine: only with --budget"),
    (["--hf-config", "x.json", "--budget", "1GiB", "--machine", "a100"], r"--machine must be a preset \(h100\)"),
    (["--hf-config", "x.json", "--pipeline", "1"], "--pipeline=1: must be an int >= 2"),
    (["--hf-config", "x.json", "--microbatches", "2"], "--microbatches: only with --pipeline"),
    (["--hf-config", "x.json", "--pipeline", "2", "--batch-size", "3"], "--batch-size=3: must be a multiple of"),
    (["--config", "c.yaml", "--pipeline", "2"], "--pipeline: only with --hf-config"),
    (["--config", "c.yaml", "--seq-len", "512", "--fused-loss"], "--seq-len, --fused-loss: with --config"),
])
def test_bad_arguments(args: list[str], message: str) -> None:
    from lightning_memkit.cli.estimate import main as estimate_main

    with pytest.raises(ConfigError, match=message):
        estimate_main(args)


def test_config_without_model_type(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ConfigError, match="model_type"):
        estimate_from_hf_config(path)


# -- input checks: every input before any work, one line each ------------------------------------------------
def _llama(**changes) -> dict:
    """The tiny Llama config.json as a dict; a change to None removes the key."""
    values = {**json.loads(tiny_hf_config("llama").to_json_string()), **changes}
    return {k: v for k, v in values.items() if v is not None}


def _gpt2() -> dict:
    """A causal LM of another layout (``transformer.h``, no ``model.layers``): not split by the pipeline."""
    import transformers

    return json.loads(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128,
                                              bos_token_id=0, eos_token_id=0).to_json_string())


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a model (one device or pipeline stages) fails the test: the inputs are checked before."""
    import lightning_memkit.estimate.hf_step as estimate_cli
    import lightning_memkit.estimate.step as estimate

    def fail(*_args, **_kwargs):
        raise AssertionError("work started before the inputs were checked")

    monkeypatch.setattr(estimate_cli, "trace_steady_step", fail)
    monkeypatch.setattr(estimate, "build_model", fail)


BAD_INPUTS = [  # (config.json content, flags, what the one line says)
    (_llama(), ["--seq-len", "1e10"], "--seq-len='1e10': must be an int >= 1, got str"),
    (_llama(), ["--batch-size", "1e11"], "--batch-size='1e11': must be an int >= 1, got str"),
    (_llama(), ["--seq-len", "10000000000"], "--batch-size 1 x --seq-len 10000000000 = 10000000000 tokens per batch: "
                                             "at most 2147483648"),
    (_llama(max_position_embeddings=2**30), ["--seq-len", "50000000", "--batch-size", "64"], "tokens per batch"),
    (_llama(), ["--seq-len", "5000"], "--seq-len 5000: at most max_position_embeddings=4096"),
    (_llama(vocab_size=0), [], "vocab_size=0: must be an int >= 1"),
    (_llama(vocab_size=-5), [], "vocab_size=-5: must be an int >= 1"),
    (_llama(hidden_size="64"), [], "hidden_size='64': must be an int >= 1, got str"),
    (_llama(num_hidden_layers=True), [], "num_hidden_layers=True: must be an int >= 1, got bool"),
    (_llama(intermediate_size=128.0), [], "intermediate_size=128.0: must be an int >= 1, got float"),
    (_llama(head_dim=None, num_attention_heads=6), [], "hidden_size=64: must be a multiple of "
                                                       r"num_attention_heads=6 \(head_dim is derived"),
    (_llama(num_attention_heads=6), [], r"hidden_size=64: must be a multiple of num_attention_heads=6 \(LlamaConfig "
                                        "requires it"),
    (_llama(num_key_value_heads=3), [], "num_attention_heads=4: must be a multiple of num_key_value_heads=3"),
    ({**json.loads(tiny_hf_config("qwen3_moe").to_json_string()), "num_experts_per_tok": 5}, [],
     "num_experts_per_tok=5: must be <= num_experts=4"),
    ([_llama()], [], "holds a JSON list; a config.json holds one object"),
    (_llama(model_type="llamma"), [], "model_type 'llamma' is not one of transformers"),
    (_gpt2(), ["--pipeline", "2", "--batch-size", "4", "--seq-len", "16"],
     r"--pipeline: model_type 'gpt2' of .* is not split by memkit_pipeline: no .model.embed_tokens \(Embedding\); no "
     r".model.layers \(ModuleList\)"),
]


@pytest.mark.parametrize("values, flags, message", BAD_INPUTS, ids=lambda x: None)
def test_a_bad_input_is_one_line_before_any_work(values, flags: list[str], message: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture, no_work: None) -> None:
    import re

    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    with pytest.raises(SystemExit) as exited:
        main(["estimate", "--hf-config", str(path), *flags])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    assert len(err.splitlines()) == 1 and err.startswith("memkit estimate: error: "), err
    assert re.search(message, err), err


def test_the_command_line_refuses_a_batch_too_large_in_one_line(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_llama()))
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--hf-config", str(path), "--seq-len", "10000000000"])
    out = capsys.readouterr()
    assert exit_.value.code == 2 and out.out == ""
    assert out.err.splitlines() == [
        "memkit estimate: error: --batch-size 1 x --seq-len 10000000000 = 10000000000 tokens per batch: at most "
        "2147483648 (2**31)"]


@pytest.mark.parametrize("call, message", [
    (lambda p: estimate_from_hf_config(p, seq_len=1e10), "--seq-len=10000000000.0: must be an int >= 1, got float"),
    (lambda p: estimate_from_hf_config(p, seq_len=2**20, batch_size=2**12), "tokens per batch: at most 2147483648"),
    (lambda p: estimate_from_hf_config(p, seq_len=8192), "--seq-len 8192: at most max_position_embeddings=4096"),
    (lambda p: _pipeline(p, 1), "--pipeline=1: must be an int >= 2"),
    (lambda p: _pipeline(p, 2, microbatches=3, batch_size=4), "--batch-size=4: must be a multiple of --microbatches=3"),
    (lambda p: _pipeline(p, 2, batch_size=2, precision="fp8"), "--precision: 'fp8' is not supported"),
])
def test_the_library_functions_check_as_the_command(call, message: str, tmp_path: Path, no_work: None) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_llama()))
    with pytest.raises(ConfigError, match=message):
        call(path)
    path.write_text(json.dumps(_llama(vocab_size=0)))
    with pytest.raises(ConfigError, match="vocab_size=0: must be an int >= 1"):
        estimate_from_hf_config(path)


def _pipeline(path: Path, stages: int, **kwargs):
    from lightning_memkit.estimate.hf import estimate_hf_pipeline

    return estimate_hf_pipeline(path, stages, **kwargs)


def test_a_head_dim_of_its_own_needs_no_dividing_heads(tmp_path: Path) -> None:
    """Qwen3 sets head_dim itself: 6 heads of 16 on a hidden size of 64 are a valid model."""
    import transformers

    from lightning_memkit.estimate.inputs import read_hf_config

    path = tmp_path / "config.json"
    path.write_text(transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                             vocab_size=256).to_json_string())
    assert read_hf_config(path).num_attention_heads == 6


def test_missing_and_unknown_keys_are_one_warning_line_each(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_llama(hidden_size=None, intermediate_size=None, head_dim=None, hiden_size=64)))
    main(["estimate", "--hf-config", str(path), "--seq-len", "8", "--optimizer", "sgd", "--json"])
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"memkit estimate: --hf-config {path}: hidden_size=4096, intermediate_size=11008 taken from LlamaConfig's "
        "defaults (the file does not set them)",
        f"memkit estimate: --hf-config {path}: hiden_size ignored: not known to LlamaConfig or its model (misspelt?)"]
    assert json.loads(out)["parameters"] > 2 * 4096 * 11008  # the estimate of the class's sizes, as warned


def test_memory_stays_flat_at_a_long_sequence(tmp_path: Path) -> None:
    """The token batch is fake: 2**26 tokens (1 GiB of input_ids and labels if real) take no host memory."""
    from lightning_memkit.memory import HostRSS

    path = tmp_path / "config.json"
    path.write_text(json.dumps(_llama(max_position_embeddings=2**20)))
    estimate_from_hf_config(path, seq_len=16, optimizer="sgd")  # imports and first-call caches
    with HostRSS(method="reset") as rss:
        est = estimate_from_hf_config(path, seq_len=2**20, batch_size=64, optimizer="sgd")
    if rss.method == "unavailable":
        pytest.skip("no RSS reading on this platform")
    assert est.peak_bytes > 2**36  # the estimate is of the long sequence
    assert rss.increase_bytes < 2**27, rss  # the positions (8 MiB a copy) stay real; the 1 GiB batch does not


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
