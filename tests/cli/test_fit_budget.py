"""``memkit fit --budget SIZE``: a MemoryBudget added to the config's callbacks, its plan in the output."""

from __future__ import annotations

import pytest
from test_cli import demo_args

from lightning_memkit.cli.main import budget_arguments, main


def test_the_budget_flag_adds_memory_budget_and_reports_its_plan(tmp_path, capsys, caplog) -> None:
    caplog.set_level("INFO")
    main(args=[*demo_args(tmp_path), "--budget", "1GiB"])
    out = capsys.readouterr().out + caplog.text
    assert "MemoryBudget: predicted peak" in out and "within the budget 1.00 GiB" in out
    assert ("MemoryBudget: budget 1.00 GiB (1,073,741,824 B); planned on the 4 longest of all 2400 samples (32 and 32 "
            "elements); plan: the run as given") in out


@pytest.mark.parametrize("args, message", [
    (["--budget"], "--budget: needs a size"),
    (["--budget", "--trainer.max_steps", "2"], "--budget: needs a size"),
    (["--budget", "3 parsecs"], "--budget: MemoryBudget(budget='3 parsecs'): not a positive size"),
    (["--budget", "1.5"], r"--budget: MemoryBudget(budget=1.5): a float is a fraction"),
    (["--budget=1GiB", "--budget", "2GiB"], "--budget: given twice"),
    (["--budget", "1e30"], "memkit fit: error: MemoryBudget(budget='1e30'): 931322574615478534144.00 GiB is more than "
                           "this machine's memory"),
])
def test_a_bad_budget_is_one_line(args, message, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(args=[*demo_args(tmp_path), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], err


def test_a_budget_no_plan_fits_is_one_line_before_any_step(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(args=[*demo_args(tmp_path), "--budget", "4KiB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 1 and len(err) == 2 and err[1] == "  add --debug for the full traceback", err
    assert err[0].startswith("memkit fit: error: MemoryBudget(budget=4096): no plan fits 4.00 KiB"), err
    assert not list(tmp_path.rglob("*.ckpt"))


def test_debug_shows_the_traceback_of_a_budget_no_plan_fits(tmp_path) -> None:
    from lightning_memkit.callbacks.memory_budget import NoPlanFits

    with pytest.raises(NoPlanFits, match="no plan fits 4.00 KiB"):
        main(args=[*demo_args(tmp_path), "--budget", "4KiB", "--debug"])


def test_the_flag_becomes_a_callback_entry() -> None:
    assert budget_arguments(["fit", "--budget=0.9", "--config", "c.yaml"]) == [
        "fit", "--config", "c.yaml", "--trainer.callbacks+=lightning_memkit.callbacks.MemoryBudget",
        "--trainer.callbacks.budget=0.9"]


def _one_error_line(args, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args=args)
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("  see ")]
    assert exit_info.value.code == 2 and len(err) == 1, err
    return err[0]


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "extra.yaml"
    path.write_text(text)
    return str(path)


def test_the_flag_is_in_fit_help(capsys) -> None:
    with pytest.raises(SystemExit):
        main(args=["fit", "--help"])
    assert "--budget BUDGET" in capsys.readouterr().out


def test_a_budget_flag_on_a_config_with_a_budget_is_refused_in_one_line(tmp_path, capsys) -> None:
    extra = _config(tmp_path, "trainer:\n  callbacks:\n    - class_path: lightning_memkit.callbacks.MemoryBudget\n"
                              "      init_args: {budget: 1GiB}\n")
    line = _one_error_line([*demo_args(tmp_path), "--config", extra, "--budget", "2GiB"], capsys)
    assert line == ("memkit fit: error: trainer.callbacks: 2 MemoryBudget callbacks ('1GiB' at trainer.callbacks[0], "
                    "'2GiB' at trainer.callbacks[1]; `--budget` adds one to the config's): give one budget")


def test_a_bad_budget_in_yaml_names_its_key_not_the_flag(tmp_path, capsys) -> None:
    extra = _config(tmp_path, "trainer:\n  callbacks:\n    - class_path: lightning_memkit.callbacks.MemoryBudget\n"
                              "      init_args: {budget: 24 GiBs}\n")
    line = _one_error_line([*demo_args(tmp_path), "--config", extra], capsys)
    assert line.startswith("memkit fit: error: trainer.callbacks[0].init_args.budget: MemoryBudget(budget='24 GiBs'): "
                           "not a positive size")


def test_a_budget_outside_fit_is_refused(tmp_path, capsys) -> None:
    args = demo_args(tmp_path)
    line = _one_error_line(["validate", *args[1:], "--budget", "1GiB"], capsys)
    assert line.startswith("memkit validate: error: budget: only `memkit fit --budget SIZE` takes a budget")


@pytest.mark.parametrize(("init_args", "expected"), [
    ("{mode: nf5, dtype: bfloat16}", "trainer.plugins[0].init_args.mode: NoSaveBitsandbytesPrecision(mode='nf5'): "
                                     "must be one of 'nf4', 'nf4-dq', 'fp4', 'fp4-dq', 'int8'"),
    ("{mode: nf4, dtype: float8}", "trainer.plugins[0].init_args.dtype: NoSaveBitsandbytesPrecision(dtype='float8'): "
                                   "not a torch dtype name; allowed: 'bfloat16', 'float16', 'float32'"),
    ("{mode: nf4, lora_rank: -1}", "trainer.plugins[0].init_args.lora_rank: NoSaveBitsandbytesPrecision("
                                   "lora_rank=-1): must be an int >= 0"),
])
def test_a_bad_plugin_argument_in_yaml_names_the_key_the_value_and_the_accepted_ones(init_args, expected, tmp_path,
                                                                                        capsys) -> None:
    pytest.importorskip("bitsandbytes")
    extra = _config(tmp_path, "trainer:\n  plugins:\n    - class_path: "
                              f"lightning_memkit.plugins.NoSaveBitsandbytesPrecision\n      init_args: {init_args}\n")
    line = _one_error_line([*demo_args(tmp_path), "--config", extra], capsys)
    assert line.startswith(f"memkit fit: error: {expected}"), line
