"""``memkit compare``: the command line of :func:`lightning_memkit.config.comparison.compare`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lightning_memkit.cli.arguments import parse_subcommand
from lightning_memkit.config.comparison import Comparison, compare
from lightning_memkit.config.errors import ConfigError
from lightning_memkit.measure.report import report_console

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="memkit compare", exit_on_error=False, allow_abbrev=False,
        description="Train a config for a few steps without and with its memkit memory features and print "
        "the peak bytes per phase. Other --key value arguments override the config as in `memkit fit`.",
    )
    p.add_argument("-c", "--config", default=None, help="a memkit / LightningCLI YAML config (required)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per run (>= 2, default 5)")
    p.add_argument("--out-dir", default=None, help="where compare.json and compare.png go "
                   "(default runs/compare/<config stem>)")
    return p


def main(argv: Sequence[str] | None = None) -> Comparison:
    """``memkit compare --config C [--steps N] [--out-dir D] [--trainer.x V ...]``: print the table, write files.

    Bad arguments raise :class:`~lightning_memkit.cli.ConfigError` (``memkit`` prints it in one line).
    """

    args, overrides = parse_subcommand(_parser(), argv)
    if args.config is None:
        raise ConfigError("--config is required: memkit compare --config path/to/config.yaml")
    result = compare(args.config, steps=args.steps, out_dir=args.out_dir, overrides=overrides)
    console = report_console()
    console.print(result.table())
    console.print(result.summary(), markup=False, highlight=False, soft_wrap=True)
    return result

