"""Names a package exports but imports only on first access (PEP 562), so that importing the package stays light.

Example::

    >>> from lightning_memkit.common.lazy import lazy_exports
    >>> __getattr__, __dir__ = lazy_exports("mypackage", {"sqrt": "math"}, {})
    >>> __getattr__("sqrt")(9.0)
    3.0
    >>> "sqrt" in __dir__()
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, str], namespace: dict[str, Any],
                 after: Callable[[str], None] | None = None) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``: ``name`` is the attribute of the module
    ``homes[name]`` (absolute, or relative to ``package`` when it starts with a dot), imported on first access and
    kept in ``namespace`` (the package's ``globals()``) for later ones; ``after(name)`` runs after each import."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(home, package if home.startswith(".") else None), name)
        namespace[name] = value  # later accesses skip __getattr__
        if after is not None:
            after(name)
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__
