"""The error every floor raises for a bad configuration value, in one line: :class:`ConfigError`."""

from __future__ import annotations

__all__ = ["ConfigError"]


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
