"""A LightningCLI configuration as a library: read it (:func:`parse_config`), run it with the memory report
(:class:`MemkitCLI`), compare it with its memory features off (:func:`compare`), and say its mistakes in one
line (:class:`ConfigError`). The ``memkit`` command (``lightning_memkit.cli``) is a thin layer over this."""

from lightning_memkit.common.lazy import lazy_exports

# imported on first access (PEP 562): `config.errors` (ConfigError) without Lightning, the rest with it
_HOMES = {"Comparison": ".comparison", "compare": ".comparison", "ConfigError": ".errors", "class_name": ".errors",
          "describe_config_error": ".errors", "LossTracker": ".lightning_cli", "MemkitCLI": ".lightning_cli",
          "instantiate": ".lightning_cli", "memory_report": ".lightning_cli", "parse_config": ".lightning_cli"}
__all__ = sorted(_HOMES)
__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())

