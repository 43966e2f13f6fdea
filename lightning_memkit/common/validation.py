"""Argument checks shared by every public entry point: one message format, one place to get them right.

Each check returns the (normalised) value or raises, naming the argument, the value given and what is
allowed. A value of the wrong type raises :class:`ArgumentTypeError`, which is both a ``TypeError``
and a ``ValueError`` (callers may catch either); a value of the right type but out of range raises
``ValueError``. ``bool`` is never accepted where a number is asked for.

Example::

    >>> from lightning_memkit.common.validation import check_int, check_number
    >>> check_int(4, "microbatches", minimum=1)
    4
    >>> check_int(0, "microbatches", minimum=1, owner="MemkitPipelineStrategy")
    Traceback (most recent call last):
    ...
    ValueError: MemkitPipelineStrategy(microbatches=0): must be an int >= 1
    >>> check_number(float("nan"), "timeout", minimum=0, min_inclusive=False)
    Traceback (most recent call last):
    ...
    ValueError: timeout=nan: must be a finite number > 0
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

__all__ = ["ArgumentTypeError", "check_int", "check_number", "check_bool", "check_choice", "check_multiple"]


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (catchable as ``TypeError`` or ``ValueError``)."""


def _label(name: str, value: Any, owner: str | None) -> str:
    return f"{owner}({name}={value!r})" if owner else f"{name}={value!r}"


def _allowed(kind: str, minimum, maximum, min_inclusive: bool, max_inclusive: bool, extras: list, none: bool) -> str:
    """``'must be an int >= 1 or 'auto' or None'``: what a numeric check accepts, in words."""
    lo = None if minimum is None else f"{'>=' if min_inclusive else '>'} {minimum}"
    hi = None if maximum is None else f"{'<=' if max_inclusive else '<'} {maximum}"
    bounds = " and ".join(b for b in (lo, hi) if b)
    return (f"must be {kind}" + (f" {bounds}" if bounds else "") + "".join(f" or {c!r}" for c in extras)
            + (" or None" if none else ""))


def _outside(v: float, minimum, maximum, min_inclusive: bool = True, max_inclusive: bool = True) -> bool:
    below = minimum is not None and (v < minimum or (v == minimum and not min_inclusive))
    above = maximum is not None and (v > maximum or (v == maximum and not max_inclusive))
    return below or above


def check_int(
    value: Any,
    name: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    allow_none: bool = False,
    also: Iterable[Any] = (),
    owner: str | None = None,
) -> Any:
    """``value`` as an int within ``[minimum, maximum]`` (either bound optional); ``None`` if ``allow_none``.

    ``also`` lists other values accepted as they are (of the same type), e.g. ``("auto",)``::

        >>> check_int("auto", "chunk_size", minimum=1, also=("auto",))
        'auto'
        >>> check_int(0, "chunk_size", minimum=1, also=("auto",))
        Traceback (most recent call last):
        ...
        ValueError: chunk_size=0: must be an int >= 1 or 'auto'
    """
    if value is None and allow_none:
        return None
    extra = list(also)
    for choice in extra:
        if type(value) is type(choice) and value == choice:
            return value
    allowed = _allowed("an int", minimum, maximum, True, True, extra, allow_none)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{_label(name, value, owner)}: {allowed}, got {type(value).__name__}")
    if _outside(value, minimum, maximum):
        raise ValueError(f"{_label(name, value, owner)}: {allowed}")
    return int(value)


def check_number(
    value: Any,
    name: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    min_inclusive: bool = True,
    max_inclusive: bool = True,
    allow_none: bool = False,
    owner: str | None = None,
) -> float | None:
    """``value`` as a finite float within the bounds (inclusive unless told); ``None`` if ``allow_none``."""
    if value is None and allow_none:
        return None
    allowed = _allowed("a finite number", minimum, maximum, min_inclusive, max_inclusive, [], allow_none)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{_label(name, value, owner)}: {allowed}, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or _outside(v, minimum, maximum, min_inclusive, max_inclusive):
        raise ValueError(f"{_label(name, value, owner)}: {allowed}")
    return v


def check_bool(value: Any, name: str, *, owner: str | None = None) -> bool:
    """``value`` if it is a bool."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{_label(name, value, owner)}: must be a bool, got {type(value).__name__}")
    return value


def check_choice(value: Any, name: str, choices: Iterable[Any], *, owner: str | None = None) -> Any:
    """``value`` if it is one of ``choices``."""
    allowed = list(choices)
    if value not in allowed:
        raise ValueError(f"{_label(name, value, owner)}: must be one of {', '.join(map(repr, allowed))}")
    return value


def check_multiple(value: int, name: str, divisor: int, divisor_name: str, *, why: str | None = None,
                   owner: str | None = None) -> int:
    """``value`` if ``divisor`` divides it (both ints >= 1, checked before); ``why`` says what needs it::

        >>> check_multiple(12, "batch_size", 5, "microbatches")
        Traceback (most recent call last):
        ...
        ValueError: batch_size=12: must be a multiple of microbatches=5
    """
    if value % divisor:
        raise ValueError(f"{_label(name, value, owner)}: must be a multiple of {divisor_name}={divisor!r}"
                         + (f" ({why})" if why else ""))
    return value
