"""Objects named by class path, as LightningCLI configs name them: ``{"class_path": "a.b.C", "init_args": {...}}``."""

from __future__ import annotations

import importlib
from collections.abc import Collection
from typing import Any

__all__ = ["base_named", "class_name", "import_object", "instantiate"]


def class_name(entry: Any) -> str:
    """The class name of a config entry (``{"class_path": "a.b.C", ...}``, ``"a.b.C"`` or ``None``).

    >>> from lightning_memkit.common.class_paths import class_name
    >>> class_name({"class_path": "lightning_memkit.callbacks.ActivationCheckpointing"}), class_name(None)
    ('ActivationCheckpointing', '')
    """
    path = entry.get("class_path", "") if isinstance(entry, dict) else str(entry or "")
    return path.rpartition(".")[2]


def base_named(obj: Any, names: Collection[str]) -> str | None:
    """The name of the first class of ``type(obj)``'s MRO that ``names`` holds, or ``None``: a class known by name,
    its module not imported (a strategy of Lightning's, subclasses included).

    >>> from lightning_memkit.common.class_paths import base_named
    >>> class Strategy: ...
    >>> class Mine(Strategy): ...
    >>> base_named(Mine(), ("Strategy", "Other")), base_named(1, ("Strategy",))
    ('Strategy', None)
    """
    return next((c.__name__ for c in type(obj).__mro__ if c.__name__ in names), None)


def import_object(path: str) -> Any:
    """The object ``path`` (``"package.module.Name"``) names.

    >>> from lightning_memkit.common.class_paths import import_object
    >>> import_object("collections.OrderedDict").__name__
    'OrderedDict'
    """
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def instantiate(entry: dict[str, Any]) -> Any:
    """The object a parsed config entry describes: ``class_path`` called with ``init_args``.

    >>> from lightning_memkit.common.class_paths import instantiate
    >>> instantiate({"class_path": "fractions.Fraction", "init_args": {"numerator": 3, "denominator": 6}})
    Fraction(1, 2)
    """
    return import_object(entry["class_path"])(**(entry.get("init_args") or {}))
