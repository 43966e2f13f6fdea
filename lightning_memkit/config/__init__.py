"""A LightningCLI configuration as a library: read it (:func:`parse_config`), run it with the memory report
(:class:`MemkitCLI`), compare it with its memory features off (:func:`compare`), and say its mistakes in one
line (:class:`ConfigError`). The ``memkit`` command (``lightning_memkit.cli``) is a thin layer over this."""

from lightning_memkit.config.comparison import Comparison, compare
from lightning_memkit.config.errors import ConfigError, class_name, describe_config_error
from lightning_memkit.config.lightning_cli import LossTracker, MemkitCLI, instantiate, memory_report, parse_config

__all__ = ["Comparison", "ConfigError", "LossTracker", "MemkitCLI", "class_name", "compare", "describe_config_error",
           "instantiate", "memory_report", "parse_config"]
