"""Sizes in bytes as people write them: ``"24GiB"``, ``"80 GB"``, ``"512MiB"``."""

from __future__ import annotations

import math

from lightning_memkit.common.errors import ConfigError

__all__ = ["parse_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"24GiB"``, ``"80 GB"``, ``"512MiB"`` or a plain number of bytes, as an int.

    Example::

        >>> from lightning_memkit.common.sizes import parse_bytes
        >>> parse_bytes("24GiB"), parse_bytes("1.5 GB"), parse_bytes(4096)
        (25769803776, 1500000000, 4096)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        s = str(text).strip().lower().replace(" ", "")
        digits = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        value, unit = (float(digits) if digits else math.nan), s[len(digits):]
    if unit not in _UNITS or not value > 0 or math.isinf(value):
        raise ConfigError(f"{text!r} is not a positive size; write e.g. 24GiB, 80GB, 512MiB or bytes")
    return int(value * _UNITS[unit])
