"""A LightningCLI configuration as a library: read it (:func:`parse_config`), run it with the memory report
(:class:`MemkitCLI`), compare it with its memory features off (:func:`compare`), and say its mistakes in one
line (:class:`ConfigError`). The ``memkit`` command (``lightning_memkit.cli``) is a thin layer over this."""

from importlib import import_module
from typing import Any

# imported on first access (PEP 562): `config.errors` (ConfigError) without Lightning, the rest with it
_HOMES = {"Comparison": "comparison", "compare": "comparison", "ConfigError": "errors", "class_name": "errors",
          "describe_config_error": "errors", "LossTracker": "lightning_cli", "MemkitCLI": "lightning_cli",
          "instantiate": "lightning_cli", "memory_report": "lightning_cli", "parse_config": "lightning_cli"}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'lightning_memkit.config' has no attribute {name!r}")
    return getattr(import_module(f"lightning_memkit.config.{_HOMES[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
