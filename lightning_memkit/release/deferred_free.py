"""Release tensors' storage once the asynchronous work that still uses them has completed.

An overlapped communication path (an all-to-all launched with ``async_op=True``, a copy on a side
CUDA stream) must not free its source buffer before the transfer is done, and the code that launches
it is rarely the code that knows when it ends. ``DeferredFree`` holds the tensors with their completion
handles; ``drain()`` releases (through :func:`~lightning_memkit.memory.release_storage`, so with the
same checks and poison mode) those whose work has completed, ``drain(wait=True)`` waits for all.

A handle (``after=``) is one of:

* ``None``: ready at the next drain;
* an object with ``is_completed()`` (``torch.distributed.Work``), waited with ``wait()``;
* an object with ``query()`` (``torch.cuda.Event``, ``torch.cuda.Stream``), waited with ``synchronize()``;
* an object with ``done()`` (``torch.futures.Future``), waited with ``wait()``.

Example::

    >>> import torch
    >>> from lightning_memkit.memory import DeferredFree
    >>> free = DeferredFree()
    >>> buf = torch.empty(1024) * 1                      # a buffer an async send still reads
    >>> entry = free.defer(buf, after=None)              # e.g. after=dist.isend(..., async_op=True)
    >>> free.drain()                                     # bytes released
    4096
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memkit.release.storage_release import (
    UnsafeReleaseError,
    call_site,
    describe_tensor,
    free_storage,
    is_released,
    poison_enabled,
    validate_tensor,
    verify_release,
)

__all__ = ["DeferredFree"]

_COMM_GRACE_S = 0.2


def _probe(after: Any) -> tuple[Any, Any]:
    """(is-done callable, wait callable) for a handle; TypeError when it is none of the supported kinds."""
    if after is None:
        return (lambda: True), (lambda: None)
    for done, wait in (("is_completed", "wait"), ("query", "synchronize"), ("done", "wait")):
        if callable(getattr(after, done, None)) and callable(getattr(after, wait, None)):
            return getattr(after, done), getattr(after, wait)
    raise TypeError(
        f"after= must be None, a work handle with is_completed()/wait(), a CUDA event or stream with "
        f"query()/synchronize(), or a future with done()/wait(); got {type(after).__name__}"
    )


@dataclass(slots=True, eq=False)
class _Pending:
    """A queued tensor (the object ``defer`` returns): ``wait()`` waits for its work without exposing it."""

    tensor: torch.Tensor
    done: Any
    wait_fn: Any
    outputs: Any
    site: str
    comm: bool  # the handle is a collective's work, which keeps the tensor until it is dropped

    def wait(self) -> None:
        """Block until the work this tensor waits for has completed."""
        if self.wait_fn is not None:
            self.wait_fn()

    def drop_handle(self) -> None:
        self.done = self.wait_fn = None

    def __repr__(self) -> str:
        state = "released" if is_released(self.tensor) else "queued"
        return f"DeferredFree entry: tensor {describe_tensor(self.tensor)}, {state}, deferred at {self.site}"


class DeferredFree:
    """A queue of tensors to release once their work handle has completed.

    Args:
        check: run :func:`~lightning_memkit.memory.release_storage`'s safety check at release time.
        poison: poison instead of freeing (default: the ``MEMKIT_POISON`` environment variable).

    The queue holds the tensors (so the storage stays valid while the work is in flight). Use it as a
    context manager to drain everything (waiting) on exit; on an exception the queue is cleared instead.
    """

    def __init__(self, *, check: bool = True, poison: bool | None = None):
        if not isinstance(check, bool):
            raise TypeError(f"DeferredFree(check=...) must be a bool, got {type(check).__name__}")
        if poison is not None and not isinstance(poison, bool):
            raise TypeError(f"DeferredFree(poison=...) must be None or a bool, got {type(poison).__name__}")
        self.check = check
        self.poison = poison
        self._queue: list[_Pending] = []
        self.released_bytes = 0

    def defer(self, t: torch.Tensor, *, after: Any = None, outputs: Any = None) -> _Pending:
        """Queue ``t`` for release once ``after`` has completed; returns the entry (``entry.wait()`` waits).

        ``outputs`` are the tensors its consumers produced (see ``release_storage``). ``t`` is validated
        now (a parameter, a leaf that requires grad or a view is refused at once); the safety check runs
        at release time. A collective's work handle keeps its tensors until the handle itself is gone:
        hand it over (``free.defer(x, after=dist.all_to_all_single(..., async_op=True))``) and wait through
        the returned entry or ``drain(wait=True)``; once it has completed, the queue drops it before the
        check. A handle you still reference yourself makes the check refuse.
        """
        validate_tensor(t)
        done, wait = _probe(after)
        entry = _Pending(t, done, wait, outputs, call_site(), callable(getattr(after, "is_completed", None)))
        self._queue.append(entry)
        return entry

    def __len__(self) -> int:
        return len(self._queue)

    def drain(self, wait: bool = False) -> int:
        """Release every queued tensor whose work has completed (all of them with ``wait=True``).

        Returns the bytes released. If the check refuses any ready tensor, nothing is released, the queue
        is left as it was and :class:`~lightning_memkit.release.storage_release.UnsafeReleaseError` names
        each refused tensor and where it was deferred.
        """
        if wait:
            for p in self._queue:
                p.wait()
        ready = [p for p in self._queue if p.done is None or wait or p.done()]
        for p in ready:
            p.drop_handle()  # a completed collective's work handle holds the tensor until it is dropped
        if self.check:
            problems = [msg for p in ready if (msg := self._problem(p, tuple(self._queue)))]
            if problems:
                raise UnsafeReleaseError("DeferredFree.drain refused: " + " | ".join(problems))
        poison = poison_enabled() if self.poison is None else self.poison
        total = 0
        ready_ids = {id(p) for p in ready}
        for p in ready:
            if not is_released(p.tensor) and p.tensor.untyped_storage().nbytes() > 0:
                total += free_storage(p.tensor, poison=poison, site=p.site)
        self._queue = [p for p in self._queue if id(p) not in ready_ids]
        self.released_bytes += total
        return total

    @staticmethod
    def _problem(p: _Pending, entries: tuple) -> str | None:
        """Why ``p``'s tensor cannot be released (None when it can).

        A communication backend drops the tensors of a completed work a moment after reporting completion
        (its worker thread still holds the work briefly): such a refusal is retried for up to 0.2 s.
        """
        if is_released(p.tensor):
            return None
        deadline = time.monotonic() + (_COMM_GRACE_S if p.comm else 0.0)
        while True:
            reasons = verify_release(p.tensor, p.outputs, held_by=entries)  # the queue's own entries
            if not reasons or time.monotonic() >= deadline:
                break
            time.sleep(0.002)
        if not reasons:
            return None
        return f"tensor {describe_tensor(p.tensor)} deferred at {p.site}: {'; '.join(reasons)}"

    def clear(self) -> None:
        """Forget every queued tensor without releasing it."""
        self._queue.clear()

    def __enter__(self) -> DeferredFree:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.drain(wait=True)
        else:
            self.clear()

    def __repr__(self) -> str:
        return f"DeferredFree(pending={len(self)}, released_bytes={self.released_bytes})"
