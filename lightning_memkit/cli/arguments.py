"""The arguments of a ``memkit`` subcommand that has its own ``argparse`` parser (``compare``, ``estimate``)."""

from __future__ import annotations

import sys
from argparse import ArgumentError
from collections.abc import Sequence
from typing import Any

from lightning_memkit.config.errors import ConfigError

__all__ = ["parse_subcommand"]


def parse_subcommand(parser: Any, argv: Sequence[str] | None) -> tuple[Any, list[str]]:
    """``(args, overrides)`` of a ``memkit`` subcommand's ``argparse`` parser: ``-h``/``--help`` prints its help
    and exits; a parse error is a :class:`ConfigError`; unknown ``--key value`` pairs are returned as overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        raise SystemExit(0)
    try:
        return parser.parse_known_args(argv)
    except ArgumentError as err:
        raise ConfigError(str(err)) from err
