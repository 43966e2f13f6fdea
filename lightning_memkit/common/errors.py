"""Errors every floor raises: :class:`ConfigError` (a bad configuration value, in one line) and the class name of a
config entry."""

from __future__ import annotations

from typing import Any

__all__ = ["ConfigError", "class_name"]


class ConfigError(ValueError):
    """A bad value in a ``memkit`` configuration; the message names the key and what is allowed.

    Example::

        >>> from lightning_memkit.common.errors import ConfigError
        >>> err = ConfigError("trainer.precision: 'fp8' is not estimated; allowed: 32-true, bf16-true")
        >>> isinstance(err, ValueError), err.hint
        (True, True)

    :func:`lightning_memkit.config.errors.describe_config_error` turns a parser's or constructor's error into one.

    ``hint=False``: ``memkit`` prints the message alone, without the line pointing to ``--help``.
    """

    def __init__(self, message: str, *, hint: bool = True) -> None:
        super().__init__(message)
        self.hint = hint


def class_name(entry: Any) -> str:
    """The class name of a config entry (``{"class_path": "a.b.C", ...}``, ``"a.b.C"`` or ``None``).

    >>> from lightning_memkit.common.errors import class_name
    >>> class_name({"class_path": "lightning_memkit.callbacks.ActivationCheckpointing"}), class_name(None)
    ('ActivationCheckpointing', '')
    """
    path = entry.get("class_path", "") if isinstance(entry, dict) else str(entry or "")
    return path.rpartition(".")[2]
