"""The ``memkit`` command: ``main`` dispatches to one thin module per subcommand (nothing imports this folder)."""

from lightning_memkit.cli.main import main

__all__ = ["main"]
