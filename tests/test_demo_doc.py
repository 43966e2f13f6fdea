"""The abridged memory report in docs/demo.md is what `memkit fit` prints for the demo config."""

import re
from pathlib import Path

from lightning_memkit.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def documented_lines() -> list[str]:
    page = (ROOT / "docs" / "demo.md").read_text()
    block = re.search(r"<!-- demo report:[^>]*-->\n```\n(.*?)```", page, re.S).group(1)
    keep = []
    for line in block.splitlines():
        if line.strip() == "..." or line.startswith("train loss:"):
            continue
        keep.append(line.split("; ...")[0].split(", ...")[0].rstrip())
    return keep


def test_demo_report_lines_in_the_docs_come_from_a_run(tmp_path, capsys):
    # the last step validates (as in the demo, which validates at its last step 150): gradients are gone at fit end
    main(args=["fit", "--config", str(ROOT / "examples/configs/tiny_lm.yaml"), "--trainer.max_steps", "1",
               "--trainer.val_check_interval", "1", "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
               "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"])
    out = capsys.readouterr().out
    printed = [line.rstrip() for line in out.splitlines()]
    lines = documented_lines()
    assert len(lines) >= 12
    for line in lines:
        assert any(p.startswith(line) for p in printed), line
