import csv
import math
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.cli import LightningCLI

from lightning_memkit.cli.main import main
from lightning_memkit.config.errors import ConfigError
from lightning_memkit.config.lightning_cli import MemkitCLI

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
CONFIG = CONFIGS / "tiny_lm.yaml"
TINY = [
    "--trainer.max_steps", "3", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    "--model.d_model", "32", "--model.n_layers", "1", "--model.n_heads", "2", "--model.seq_len", "32",
    "--data.seq_len", "32", "--data.batch_size", "4", "--data.max_bytes", "20000",
]
LOSS_LINE = re.compile(r"train loss: first (\S+) -> last (\S+) over (\d+) optimizer steps")


def demo_args(tmp_path):
    return ["fit", "--config", str(CONFIG), "--trainer.default_root_dir", str(tmp_path),
            "--trainer.logger.init_args.save_dir", str(tmp_path), *TINY]


def eval_args(subcommand, tmp_path, config=CONFIG, overrides=TINY[6:]):
    """``subcommand`` on a tiny model (``overrides``) without a logger, limited to 2 batches."""
    return [subcommand, "--config", str(config), "--trainer.default_root_dir", str(tmp_path), "--trainer.logger",
            "false", f"--trainer.limit_{subcommand.replace('validate', 'val')}_batches", "2", *overrides]


def config_error(capsys, args):
    """Run ``main(args)``, which must stop on a configuration error; return its stderr lines."""
    with pytest.raises(SystemExit) as exit_info:
        main(args=args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("Seed set")]
    assert "Traceback" not in err
    assert len(lines) == 2 and lines[1].strip().startswith("see `memkit"), err
    return lines


def test_demo_config_prints_the_memory_report_and_trains(tmp_path, capsys):
    main(args=demo_args(tmp_path))
    out = capsys.readouterr().out
    report = out[out.index("memkit memory report"):]
    # PeakMemoryMonitor summary, printed once (in the report, not also at the end of training)
    assert out.count("Peak memory per training step") == 1
    assert "cpu (LivePeak)" in report and "max step peak" in report
    # SavedTensorProfiler: per-layer table and where its files went
    assert "blocks.0" in report and "Saved-tensor report written to:" in report
    written = [Path(line.strip()) for line in report.splitlines() if line.strip().endswith((".json", ".png"))]
    assert {p.suffix for p in written} == {".json", ".png"} and all(p.is_file() for p in written)
    assert all(tmp_path in p.parents for p in written)
    # first and last loss: three steps ran and the loss fell (lr 3e-3 from a near-uniform start)
    first, last, steps = LOSS_LINE.search(report).groups()
    assert int(steps) == 3 and float(last) < float(first)
    assert abs(float(first) - math.log(256)) < 0.2  # the untrained model is near uniform over 256 bytes
    # the CSV logger wrote the logged train/val losses
    (metrics,) = tmp_path.rglob("metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    assert any(r.get("val_loss") for r in rows)


def test_the_loss_line_under_gradient_accumulation_is_the_logged_loss(tmp_path, capsys):
    main(args=[*demo_args(tmp_path), "--trainer.accumulate_grad_batches", "4", "--trainer.log_every_n_steps", "1",
               "--trainer.limit_val_batches", "0"])
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("train loss:")]
    (metrics,) = tmp_path.rglob("metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("train_loss")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2]  # one row per optimizer step
    first, last = float(rows[0]["train_loss"]), float(rows[-1]["train_loss"])
    assert first > 4  # near ln(256): not Lightning's loss / 4
    assert line == (f"train loss: first {first:.4f} -> last {last:.4f} over 3 optimizer steps "
                    "(12 micro-batches, accumulate_grad_batches=4)")


def test_other_module_by_class_path(tmp_path, capsys):
    args = [
        "fit", "--model", "lightning_memkit.demo.TinyMoE", "--data", "lightning_memkit.demo.ByteTextDataModule",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.accelerator", "cpu", "--trainer.logger", "false",
        "--trainer.enable_checkpointing", "false", *TINY[:8], "--model.d_model", "32", "--model.seq_len", "32",
        "--model.n_experts", "4", "--model.top_k", "2", "--data.seq_len", "32", "--data.batch_size", "4",
        "--data.max_bytes", "20000",
    ]
    cli = MemkitCLI(args=args)
    out = capsys.readouterr().out
    assert type(cli.model).__name__ == "TinyMoE" and cli.trainer.global_step == 3
    assert "No memkit memory callback ran" in out  # no memory callbacks configured
    assert int(LOSS_LINE.search(out).group(3)) == 3


def test_torch_num_threads_applies_to_the_run_only(tmp_path, monkeypatch, capsys):
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n)))
    before = torch.get_num_threads()
    main(args=[*demo_args(tmp_path), "--trainer.max_steps", "1", "--torch_num_threads", "3"])
    assert calls == [3, before]
    assert torch.get_num_threads() == before
    calls.clear()
    lines = config_error(capsys, ["fit", "--config", str(CONFIG), "--torch_num_threads", "0"])
    assert lines[0] == ("memkit fit: error: torch_num_threads: MemkitCLI(torch_num_threads=0): must be an int >= 1 "
                        "or None")
    assert calls == [before]  # nothing applied, only the restore
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("override, expected", [
    (["--model.n_layers=-1"], "memkit fit: error: model.init_args.n_layers: TinyLM(n_layers=-1): must be an int >= 1"),
    (["--model.loss", "chunked"],
     "memkit fit: error: model.init_args.loss: TinyLM(loss='chunked') is not supported; allowed: 'standard', 'fused'"),
    (["--model.n_layer=2"],
     "memkit fit: error: model: Option 'n_layer' is not accepted by lightning_memkit.demo.TinyLM; "
     "accepted: d_model, n_layers, n_heads, seq_len, lr, weight_decay, loss"),
    (["--trainer.max_step=2"], "memkit fit: error: unrecognized arguments: --trainer.max_step=2"),  # no abbreviations
    (["--trainer.max_steps=abc"], "memkit fit: error: trainer.max_steps: expected int. Got value: abc"),
    (["--model.d_model=abc"], "memkit fit: error: model.d_model: expected int. Got value: abc"),
    (["--model=lightning_memkit.demo.Nope"],
     "memkit fit: error: model: class_path 'lightning_memkit.demo.Nope' cannot be imported: "
     "module 'lightning_memkit.demo' has no attribute 'Nope'"),
    (["--trainer.max_steps=-5"], "memkit fit: error: trainer: `max_steps` must be a non-negative integer or -1"),
    (["--trainer.precision=bf17-true"],
     "memkit fit: error: trainer.precision: 'bf17-true' is not a precision; accepted: 64, 32, 16, "),
])
def test_a_bad_config_value_is_one_line_naming_the_key(capsys, override, expected):
    lines = config_error(capsys, ["fit", "--config", str(CONFIG), "--trainer.logger", "false", *override])
    assert lines[0].startswith(expected), lines[0]


def test_a_callback_constructor_error_names_its_config_entry(tmp_path, capsys):
    config = yaml.safe_load(CONFIG.read_text())
    config["trainer"]["callbacks"][0]["init_args"]["log_every_n_steps"] = 0  # PeakMemoryMonitor
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    lines = config_error(capsys, ["fit", "--config", str(path)])
    assert lines[0] == ("memkit fit: error: trainer.callbacks[0].init_args.log_every_n_steps: "
                        "PeakMemoryMonitor(log_every_n_steps=0): must be an int >= 1")


def test_debug_flag_or_env_shows_the_traceback(monkeypatch):
    args = ["fit", "--config", str(CONFIG), "--model.n_layers=-1"]
    with pytest.raises(ConfigError, match=r"n_layers=-1") as info:
        main(args=[*args, "--debug"])  # --debug anywhere; not passed on to the parser
    assert isinstance(info.value.__cause__, ValueError)
    assert "TinyLM(n_layers=-1): must be an int >= 1" in str(info.value.__cause__)
    monkeypatch.setenv("MEMKIT_DEBUG", "1")
    with pytest.raises(ConfigError):
        main(args=args)


def test_an_error_while_training_keeps_its_traceback(tmp_path):
    # the model's positions end at 16, the batches are 32 long: the first forward raises
    with pytest.raises(ValueError, match=r"sequence length 32 exceeds TinyLM\(seq_len=16\)"):
        main(args=["fit", "--config", str(CONFIG), "--trainer.default_root_dir", str(tmp_path), "--trainer.logger",
                   "false", *TINY, "--model.seq_len", "16"])


def test_logger_false_twice_in_the_same_directory(tmp_path):
    args = ["fit", "--config", str(CONFIG), "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false",
            *TINY]
    first = MemkitCLI(args=[*args, "--trainer.max_steps", "1"])
    second = MemkitCLI(args=[*args, "--trainer.max_steps", "2"])  # Lightning's default refuses: config.yaml exists
    assert (first.trainer.global_step, second.trainer.global_step) == (1, 2)
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 2  # the second run's configuration


def test_only_the_chosen_subcommand_gets_a_parser(tmp_path, monkeypatch):
    """``fit ...`` builds the parser of ``fit`` alone (the others' would double the start-up); arguments that name
    no subcommand, or a run without subcommands, keep Lightning's whole list."""
    every = LightningCLI.subcommands()
    cli = MemkitCLI(args=eval_args("validate", tmp_path))
    assert cli.subcommand == "validate" and cli.subcommands() == {"validate": every["validate"]}
    monkeypatch.setattr(sys, "argv", ["memkit", *eval_args("test", tmp_path)])
    assert MemkitCLI(args=None).subcommands() == {"test": every["test"]}  # the command line's
    bare = MemkitCLI(args=["--config", str(CONFIG), *TINY, "--trainer.logger", "false"], run=False)
    assert bare.subcommands() == every
    choices = r"invalid choice: 'fitt' \(choose from 'fit', 'validate', 'test', 'predict'\)"
    with pytest.raises(ConfigError, match=choices):  # not a subcommand: every parser, as Lightning's
        MemkitCLI(args=["fitt", "--config", str(CONFIG)])


@pytest.mark.parametrize("subcommand", ["validate", "test"])
def test_validate_and_test_log_the_loss_of_the_untrained_model(tmp_path, subcommand):
    cli = MemkitCLI(args=eval_args(subcommand, tmp_path))
    key = "val_loss" if subcommand == "validate" else "test_loss"
    loss = float(cli.trainer.callback_metrics[key])
    assert abs(loss - math.log(256)) < 0.2  # near-uniform initial predictions over 256 bytes
    assert cli.trainer.global_step == 0


def test_predict_returns_the_greedy_next_bytes(tmp_path, capsys):
    cli = MemkitCLI(args=eval_args("predict", tmp_path))
    predictions = cli.trainer.predict_loop.predictions
    assert len(predictions) == 2 and all(p.shape == (4, 32) and p.dtype == torch.int64 for p in predictions)
    x, _ = next(iter(cli.datamodule.predict_dataloader()))
    with torch.no_grad():
        assert torch.equal(predictions[0], cli.model(x).argmax(-1))
    assert "predict: 2 batches, 8 samples; first batch: torch.int64 tensor of shape (4, 32)" in capsys.readouterr().out


def test_moe_and_hf_models_test_and_predict(tmp_path):
    moe = MemkitCLI(args=eval_args("test", tmp_path, CONFIGS / "tiny_moe.yaml", [
        "--model.d_model", "32", "--model.seq_len", "32", "--model.n_experts", "4", "--model.top_k", "2",
        "--data.seq_len", "32", "--data.batch_size", "4", "--data.max_bytes", "20000",
        "--trainer.enable_progress_bar", "false"]))
    assert abs(float(moe.trainer.callback_metrics["test_loss"]) - math.log(256)) < 0.2
    hf = [
        "--trainer.enable_progress_bar", "false", "--model.hidden_size", "16", "--model.num_layers", "1",
        "--data.seq_len", "16", "--data.batch_size", "2", "--data.max_bytes", "20000",
    ]
    config = CONFIGS / "hf_gpt_oss_checkpointing.yaml"
    cli = MemkitCLI(args=eval_args("predict", tmp_path, config, hf))
    predictions = cli.trainer.predict_loop.predictions
    assert len(predictions) == 2 and all(p.shape == (2, 16) and p.dtype == torch.int64 for p in predictions)
    batch = next(iter(cli.datamodule.predict_dataloader()))
    with torch.no_grad():
        assert torch.equal(predictions[0], cli.model.model(input_ids=batch["input_ids"]).logits.argmax(-1))
    tested = MemkitCLI(args=eval_args("test", tmp_path, config, hf))
    assert tested.model.model.config.vocab_size == 256
    assert abs(float(tested.trainer.callback_metrics["test_loss"]) - math.log(256)) < 0.2  # untrained: near uniform


def test_compare_goes_to_the_compare_module(monkeypatch, capsys):
    seen = []

    def compare_main(argv):
        seen.append(argv)
        if "--bad" in argv:
            raise ConfigError("--bad: not an option of memkit compare")

    monkeypatch.setitem(sys.modules, "lightning_memkit.cli.compare", types.SimpleNamespace(main=compare_main))
    main(args=["compare", "--config", "c.yaml", "--debug", "--runs", "2"])
    assert seen == [["--config", "c.yaml", "--runs", "2"]]
    with pytest.raises(SystemExit) as info:
        main(args=["compare", "--bad"])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("memkit compare: error: --bad: not an option of memkit compare\n")
    with pytest.raises(ConfigError):
        main(args=["compare", "--bad", "--debug"])


def exit_code(args):
    with pytest.raises(SystemExit) as info:
        main(args=args)
    return info.value.code


def test_memkit_alone_and_help_list_every_subcommand(capsys):
    for args, code in (([], 2), (["--help"], 0)):
        assert exit_code(args) == code
        captured = capsys.readouterr()
        text = captured.err if code else captured.out
        listed = re.findall(r"^  (\w+)  +\S", text, re.M)
        assert listed == ["fit", "validate", "test", "predict", "compare", "estimate", "export"], text
    for subcommand, option in (("fit", "--trainer.max_steps"), ("compare", "--steps"), ("export", "--ckpt_path")):
        assert exit_code([subcommand, "--help"]) == 0
        assert option in capsys.readouterr().out


def test_an_unknown_subcommand_is_one_line_listing_them(capsys):
    assert exit_code(["fitt", "--config", str(CONFIG)]) == 2
    assert capsys.readouterr().err == ("memkit: error: unknown subcommand 'fitt'; choose from fit, validate, test, "
                                       "predict, compare, estimate, export (memkit --help)\n")


UNCLOSED = "trainer:\n  max_steps: 2\n  callbacks: [a, b\nmodel:\n  class_path: x\n"
UNCLOSED_ERROR = ("line 4, column 6: expected ',' or ']', but got ':' (while parsing a flow sequence at line 3, "
                  "column 14)")
TAB = "trainer:\n\tmax_steps: 2\n"
TAB_ERROR = "line 2, column 1: found character '\\t' that cannot start any token (while scanning for the next token)"


@pytest.mark.parametrize("subcommand, text, error", [
    ("fit", UNCLOSED, UNCLOSED_ERROR), ("validate", TAB, TAB_ERROR), ("compare", UNCLOSED, UNCLOSED_ERROR),
    ("estimate", TAB, TAB_ERROR),
], ids=["fit-bracket", "validate-tab", "compare-bracket", "estimate-tab"])
def test_a_yaml_syntax_error_is_one_line_naming_the_file_and_line(tmp_path, capsys, subcommand, text, error):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert exit_code([subcommand, "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"memkit {subcommand}: error: --config {path}: invalid YAML at {error}\n"




def test_the_console_script_imports_a_model_beside_the_working_directory(tmp_path):
    """``memkit fit`` (the console script) finds ``mylm.MyLM`` in ``./mylm.py`` as ``python -m`` would."""
    import subprocess

    script = Path(sys.executable).parent / "memkit"
    if not script.exists():
        pytest.skip("the memkit console script is not installed beside this interpreter")
    (tmp_path / "mylm.py").write_text("from lightning_memkit.demo import TinyLM\n\n\nclass MyLM(TinyLM):\n"
                                      "    marker = 'mine'\n")
    args = [str(script), *demo_args(tmp_path), "--model", "mylm.MyLM", "--trainer.max_steps", "1",
            "--trainer.limit_val_batches", "0"]
    ran = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "MyLM" in ran.stdout + ran.stderr



def test_a_missing_model_module_names_the_working_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([*demo_args(tmp_path), "--model", "nolm.NoLM"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "No module named 'nolm'" in err and f"working directory {tmp_path}" in err


def test_ckpt_path_last_resumes_from_the_logged_runs_newest_version_or_stops_in_one_line(tmp_path, capsys):
    """With a logger, each run writes into a new version folder: ``--ckpt_path last`` finds the last checkpoint of
    the earlier version (Lightning alone looks in the new one, finds nothing and trains from step 0); where there
    is none, one line names where it looked, before any step."""
    checkpoints = ["--trainer.enable_checkpointing", "true",
                   "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                   "--trainer.callbacks.save_last=true", "--trainer.callbacks.every_n_train_steps=1"]
    args = [*demo_args(tmp_path / "run"), *checkpoints]
    main(args=[*args, "--trainer.max_steps", "2"])
    capsys.readouterr()
    main(args=[*args, "--trainer.max_steps", "3", "--ckpt_path", "last"])
    assert LOSS_LINE.search(capsys.readouterr().out).group(3) == "1"  # step 3 only: resumed at step 2
    assert sorted(p.parent.parent.name for p in (tmp_path / "run").rglob("last.ckpt")) == ["version_0", "version_1"]
    with pytest.raises(SystemExit) as stopped:
        main(args=[*demo_args(tmp_path / "empty"), *checkpoints, "--ckpt_path", "last"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("memkit")]
    assert stopped.value.code == 2 and err == [
        f"memkit fit: error: --ckpt_path last: no last*.ckpt in {tmp_path / 'empty' / 'lightning_logs'}"
        f"{'/'}version_*/checkpoints; nothing to resume (leave --ckpt_path out to start from step 0, or give a "
        "checkpoint's path)"]
