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
])
def test_a_bad_budget_is_one_line(args, message, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(args=[*demo_args(tmp_path), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], err


def test_the_flag_becomes_a_callback_entry() -> None:
    assert budget_arguments(["fit", "--budget=0.9", "--config", "c.yaml"]) == [
        "fit", "--config", "c.yaml", "--trainer.callbacks+=lightning_memkit.callbacks.MemoryBudget",
        "--trainer.callbacks.budget=0.9"]
