"""What the shipped-config tests share: the configs, the short run of each subcommand and the checks of its output."""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import ranks

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
PIPELINES = sorted(p.name for p in CONFIGS.glob("*.yaml") if "pipeline" in p.name)
SINGLE = sorted(p.name for p in CONFIGS.glob("*.yaml") if "pipeline" not in p.name)
LOSS_LINE = re.compile(r"train loss: first (\S+) -> last (\S+) over (\d+) optimizer steps")
SHORT = {
    "fit": ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "1"],
    "validate": ["--trainer.limit_val_batches", "2"],
    "test": ["--trainer.limit_test_batches", "2"],
    "predict": ["--trainer.limit_predict_batches", "2"],
}


def memkit(*args: str, cwd: Path | None = None, timeout: int = 280) -> subprocess.CompletedProcess:
    """``memkit <args>`` in a process of its own (``python -m lightning_memkit.cli``, forked by the zygote of
    ``ranks``; Lightning starts the other ranks as fresh interpreters)."""
    return ranks.run(["-m", "lightning_memkit.cli", *args], timeout=timeout, cwd=cwd)


def short_args(subcommand: str, config: str, root: Path) -> list[str]:
    """The arguments of a short ``memkit <subcommand>`` of the shipped ``config``, writing under ``root``."""
    return [subcommand, "--config", str(CONFIGS / config), "--trainer.default_root_dir", str(root / subcommand),
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", *SHORT[subcommand]]


def check_output(subcommand: str, config: str, out: str) -> None:
    """What a short run of ``subcommand`` on ``config`` must print: two optimizer steps of a loss near ln(256) for
    these untrained byte models, a finite validation/test loss, two batches of predictions of the right kind."""
    if subcommand == "fit":
        first, last, steps = LOSS_LINE.search(out).groups()
        assert int(steps) == 2 and 3 < float(first) < 8 and 3 < float(last) < 8, out[-2000:]
    elif subcommand in ("validate", "test"):
        metric = "val_loss" if subcommand == "validate" else "test_loss"
        value = float(re.search(rf"{metric}\s*│\s*(\S+)", out).group(1))
        assert math.isfinite(value) and 3 < value < 8
    else:  # the pipeline returns the last layer's output (logits), the models their greedy next tokens
        kind = r"torch.float32 tensor of shape \(\d+, \d+, 256\)" if "pipeline" in config else "torch.int64 tensor"
        assert re.search(rf"predict: 2 batches, \d+ samples; first batch: {kind}", out), out[-2000:]
