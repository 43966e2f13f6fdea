"""`memkit compare`: the same config with and without memkit's memory features, measured per phase."""

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from lightning_memkit.cli.compare import main
from lightning_memkit.config.comparison import PHASES, compare, split_features
from lightning_memkit.config.errors import ConfigError
from lightning_memkit.demo import TinyLM

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
SMALL = ["--model.d_model", "32", "--model.n_layers", "2", "--model.n_heads", "2", "--model.seq_len", "32",
         "--data.seq_len", "32", "--data.batch_size", "4", "--data.max_bytes", "20000"]


def param_bytes(**kw) -> int:
    model = TinyLM(**kw)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def write_config(tmp_path, callbacks, **trainer):
    base = yaml.safe_load((CONFIGS / "tiny_lm.yaml").read_text())
    base["trainer"]["callbacks"] = callbacks
    base["trainer"].update(trainer)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


RELEASE = {"class_path": "lightning_memkit.callbacks.PhaseMemoryRelease", "init_args": {"after": ["fit"]}}
MONITOR = {"class_path": "lightning_memkit.callbacks.PeakMemoryMonitor"}


def test_phase_release_alone_changes_only_the_between_phases_row_by_exactly_grads_and_adam_state(tmp_path):
    result = compare(write_config(tmp_path, [MONITOR, RELEASE]), steps=2, out_dir=tmp_path / "out",
                     overrides=SMALL)
    rows = {r.phase: r for r in result.rows}
    assert result.features == ["PhaseMemoryRelease"]
    assert [r.phase for r in result.rows] == [*PHASES, "whole run"]
    # the feature acts after fit only: every step of both runs is the same, byte for byte
    for phase in ("setup/load", "forward+backward", "optimizer step"):
        assert rows[phase].baseline_bytes == rows[phase].memkit_bytes > 0, phase
    # after fit, the memkit run no longer holds gradients, exp_avg and exp_avg_sq: three copies of the weights
    weights = param_bytes(d_model=32, n_layers=2, n_heads=2, seq_len=32)
    assert rows["between phases"].saved_bytes == 3 * weights
    assert rows["between phases"].memkit_bytes >= weights  # the weights themselves stay
    assert result.baseline.steps == result.memkit.steps == 2
    assert result.baseline.loss_first == result.memkit.loss_first
    assert any(line.startswith("PhaseMemoryRelease: after fit:") for line in result.memkit.effects)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """`memkit compare --config examples/configs/tiny_lm.yaml`, as docs/compare.md runs it, once for the tests
    that check it: its result, what it printed and its output folder."""
    out = tmp_path_factory.mktemp("demo") / "out"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = main(["--config", str(CONFIGS / "tiny_lm.yaml"), "--out-dir", str(out)])
    return result, printed.getvalue(), out


def test_demo_config_checkpointing_cuts_the_step_peak_and_files_agree_with_the_table(demo_run):
    result, printed, out = demo_run
    rows = {r.phase: r for r in result.rows}
    assert result.features == ["ActivationCheckpointing", "PhaseMemoryRelease"]
    assert result.steps == result.baseline.steps == result.memkit.steps == 5  # the default of --steps
    assert rows["setup/load"].saved_bytes == 0 and rows["optimizer step"].saved_bytes == 0
    assert rows["forward+backward"].memkit_bytes < 0.8 * rows["forward+backward"].baseline_bytes
    assert rows["whole run"].baseline_bytes == max(rows[p].baseline_bytes for p in PHASES[:3])
    # recomputation changes no number: same losses in both runs
    assert result.memkit.loss_last == pytest.approx(result.baseline.loss_last, rel=1e-6)
    assert f"{rows['forward+backward'].saved_bytes:,}" in printed and "ActivationCheckpointing:" in printed
    data = json.loads((out / "compare.json").read_text())
    assert [(p["phase"], p["baseline_bytes"], p["memkit_bytes"], p["saved_bytes"]) for p in data["phases"]] == [
        (r.phase, r.baseline_bytes, r.memkit_bytes, r.saved_bytes) for r in result.rows]
    assert data["features"] == result.features and data["measured_with"].startswith("LivePeak")
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_split_features_removes_memkit_plugins_strategy_and_callbacks_only_from_the_baseline():
    config = {"trainer": {
        "strategy": {"class_path": "lightning_memkit.strategies.MemkitPipelineStrategy", "init_args": {}},
        "plugins": [{"class_path": "lightning_memkit.plugins.NoSaveBitsandbytesPrecision"},
                    {"class_path": "lightning.pytorch.plugins.environments.LightningEnvironment"}],
        "callbacks": [{"class_path": "lightning_memkit.callbacks.SavedTensorProfiler"},
                      {"class_path": "lightning_memkit.callbacks.ActivationCheckpointing"}],
    }}
    memkit, baseline, features = split_features(config)
    assert features == ["ActivationCheckpointing", "NoSaveBitsandbytesPrecision", "MemkitPipelineStrategy"]
    assert baseline["trainer"]["strategy"] == "auto" and baseline["trainer"]["callbacks"] == []
    assert baseline["trainer"]["plugins"] == [config["trainer"]["plugins"][1]]
    assert memkit["trainer"]["plugins"] == config["trainer"]["plugins"]
    assert memkit["trainer"]["strategy"] == config["trainer"]["strategy"]
    assert len(config["trainer"]["callbacks"]) == 2  # the input is not mutated


def test_errors_name_the_argument_before_anything_runs(tmp_path, monkeypatch):
    def no_run(*a, **k):
        raise AssertionError("a run started")

    monkeypatch.setattr("lightning_memkit.config.comparison._run", no_run)
    with pytest.raises(ConfigError, match="--config: no such file"):
        compare(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"--steps: compare\(steps=1\): must be an int >= 2"):
        compare(CONFIGS / "tiny_lm.yaml", steps=1)
    with pytest.raises(ConfigError, match="turns on no memkit memory feature"):
        compare(write_config(tmp_path, [MONITOR]), overrides=SMALL)
    with pytest.raises(ConfigError, match="trainer.devices: 2 x num_nodes 1 needs several processes"):
        compare(CONFIGS / "tiny_lm_pipeline.yaml")
    with pytest.raises(ConfigError, match="--config is required"):
        main([])


def test_memkit_compare_command_prints_one_line_errors(capsys):
    from lightning_memkit.cli.main import main as memkit_main

    with pytest.raises(SystemExit) as info:
        memkit_main(["compare", "--config", str(CONFIGS / "tiny_lm.yaml"), "--steps", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "memkit compare: error: --steps: compare(steps=0): must be an int >= 2"
    assert len(err) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.cuda
def test_cuda_rows_carry_max_memory_allocated(tmp_path):
    result = compare(write_config(tmp_path, [RELEASE], accelerator="gpu"), steps=2, out_dir=tmp_path / "out",
                     overrides=SMALL)
    for row in result.rows:
        assert row.baseline_cuda is not None and row.baseline_cuda >= row.baseline_bytes


def test_the_table_in_docs_compare_is_what_a_fresh_run_prints(demo_run):
    """docs/compare.md shows the demo config's table: it must be the one the command prints now."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "compare.md").read_text()
    config, block = re.search(r"<!-- compare: (\S+) -->\n```\n(.*?)```", page, re.S).groups()
    assert config == "examples/configs/tiny_lm.yaml"  # the config demo_run compares
    documented = [tuple(c.strip() for c in line.strip("│").split("│")) for line in block.splitlines()
                  if line.startswith("│")]
    result, printed, _ = demo_run
    fresh = [(r.phase, f"{r.baseline_bytes:,}", f"{r.memkit_bytes:,}", f"{r.saved_bytes:,}", f"{r.ratio:.3f}x")
             for r in result.rows]
    assert documented == fresh
    assert block in printed  # as printed, borders and alignment included


def test_qlora_setup_row_is_above_the_baseline_as_documented(tmp_path):
    result = compare(CONFIGS / "tiny_lm_qlora.yaml", steps=2, out_dir=tmp_path, overrides=SMALL)
    rows = {r.phase: r for r in result.rows}
    assert result.features == ["NoSaveBitsandbytesPrecision"]
    assert rows["setup/load"].memkit_bytes > rows["setup/load"].baseline_bytes
    assert rows["optimizer step"].memkit_bytes < rows["optimizer step"].baseline_bytes  # frozen 4-bit base
