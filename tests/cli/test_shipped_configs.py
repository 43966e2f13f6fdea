"""Every shipped single-process config runs fit, validate, test and predict (in one interpreter per config: the
four subcommands as ``memkit`` runs them, one start-up instead of four)."""

from __future__ import annotations

from pathlib import Path

import pytest
import ranks
from shipped_configs import SHORT, SINGLE, check_output, short_args

DRIVER = """
import sys
from lightning_memkit.cli.main import main
for args in {runs!r}:
    print("=== memkit " + args[0], flush=True)
    main(args)
    sys.stdout.flush()
"""


@pytest.mark.slow
@pytest.mark.parametrize("config", SINGLE)
def test_every_subcommand_runs_every_shipped_config(tmp_path: Path, config: str) -> None:
    runs = [short_args(subcommand, config, tmp_path) for subcommand in SHORT]
    proc = ranks.run(["-c", DRIVER.format(runs=runs)], timeout=600)  # a process of its own, from the zygote
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = proc.stdout.split("=== memkit ")[1:]
    assert [p.split("\n", 1)[0] for p in parts] == list(SHORT)
    for subcommand, part in zip(SHORT, parts, strict=True):
        check_output(subcommand, config, part)
