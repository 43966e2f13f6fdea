"""A loop of alike iterations run once on fake tensors (an estimate), its counts taken as often as it would run.

On fake tensors an op costs the same whatever its sizes, and an op that allocates costs the most (~0.3 ms): a loop
over thin slices of a wide weight (the fused loss's backward on a CPU walks the vocabulary a few columns at a time)
runs thousands of alike iterations whose storages come and go the same way, and an estimate of a long sequence
spends minutes in it. Such a loop runs one iteration of each kind instead, inside :func:`stands_for`; the counters
of a fake step (the FLOPs of :class:`~lightning_memkit.estimate.fast_ops.FastOps`, the bytes allocated of
:class:`~lightning_memkit.estimate.trace.CategoryTracker`) multiply what they count there by
:func:`repeat_factor`. The peak is unchanged: every iteration allocates and frees the same storages.

Example::

    >>> with stands_for(3):
    ...     with stands_for(2):
    ...         repeat_factor()
    6
    >>> repeat_factor()
    1
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["alike_runs", "allocation_factor", "estimating", "repeat_factor", "stands_for"]

_FACTOR = [1]
_ALLOCATIONS = [1]


def repeat_factor() -> int:
    """How many iterations the ops running now stand for (1 outside :func:`stands_for`)."""
    return _FACTOR[0]


def allocation_factor() -> int:
    """How many times the storages allocated now count among the bytes a step allocates (:func:`repeat_factor`
    unless :func:`stands_for` was given ``allocations``)."""
    return _ALLOCATIONS[0]


def stands_for(count: int, allocations: int | None = None) -> contextlib.AbstractContextManager[None]:
    """The ops inside count ``count`` times (nested: the product), their allocations ``allocations`` times (default
    ``count``; 0: storages standing for ones already counted); a count of 1 is a plain ``nullcontext`` (no state
    touched, so a loop compiled by ``torch.compile`` traces through it)."""
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"stands_for(count={count!r}): a positive int")
    allocations = count if allocations is None else allocations
    if not isinstance(allocations, int) or allocations < 0:
        raise ValueError(f"stands_for(allocations={allocations!r}): an int >= 0")
    return contextlib.nullcontext() if count == 1 and allocations == 1 else _standing(count, allocations)


@contextlib.contextmanager
def _standing(count: int, allocations: int) -> Iterator[None]:
    before = _FACTOR[0], _ALLOCATIONS[0]
    _FACTOR[0] *= count
    _ALLOCATIONS[0] *= allocations
    try:
        yield
    finally:
        _FACTOR[0], _ALLOCATIONS[0] = before


def estimating(x: Any) -> bool:
    """Whether ``x`` is a fake tensor of a memory estimate (not one ``torch.compile`` traces with): a loop over it
    may run its alike iterations once (:func:`alike_runs`)."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    return not torch.compiler.is_compiling() and is_fake(x)


def alike_runs(stop: int, step: int, fake: bool) -> list[tuple[int, int]]:
    """``(start, count)`` for a loop ``range(0, stop, step)``: each start once (``count`` 1) unless ``fake``, then the
    first full step standing for every full one and the last, shorter one (if any) for itself.

        >>> alike_runs(10, 3, fake=True), alike_runs(9, 3, fake=True), alike_runs(4, 3, fake=False)
        ([(0, 3), (9, 1)], [(0, 3)], [(0, 1), (3, 1)])
    """
    if not fake:
        return [(s, 1) for s in range(0, stop, step)]
    full = stop // step
    runs = [(0, full)] if full else []
    return runs + ([(full * step, 1)] if stop % step else [])
