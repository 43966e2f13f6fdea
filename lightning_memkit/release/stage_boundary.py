"""Mark the tensors handed between the stages of a layer; free their storage once their consumers have run.

In a mixture-of-experts layer the dispatch input, the gathered tokens and the expert outputs are each
read by one stage and afterwards needed only as autograd metadata, yet a schedule that keeps stage
outputs for a stage-wise backward, or an op that saves a tensor only for its shape
(``index_add``'s ``source``), keeps their bytes until the layer's backward. A layer marks them::

    x = stage_boundary(x, consumers=self.exchange)        # released after self.exchange's forward
    y = combine(x, ...)
    stage_boundary(x, consumers=y)                        # the consumer already ran: released now

``consumers`` is either the module(s) that read the tensor (it is released once each has finished one
forward after the mark; their outputs are what the safety check searches) or the tensor(s) the
consumers produced (released at once). Marking is a no-op unless a :func:`release_stage_boundaries`
block is active (the :class:`~lightning_memkit.callbacks.StageBoundaryRelease` callback opens one around
each training step), so the same model runs unchanged elsewhere. The release goes through
:func:`~lightning_memkit.memory.release_storage`: with ``check=True`` a release that torch can see is
unsafe (the consumer returned its input, as an exchange does with expert parallelism off; a consumer
saved it for backward) raises :class:`~lightning_memkit.release.storage_release.UnsafeReleaseError`, or
with ``on_refuse="keep"`` keeps the tensor and records why in the block's :class:`BoundaryStats`.
Nothing changes numerically: gradients are bitwise identical with and without the release.

Example::

    >>> import torch
    >>> from lightning_memkit.memory import release_stage_boundaries, stage_boundary
    >>> a = torch.randn(64, 8, requires_grad=True)
    >>> with release_stage_boundaries() as stats:
    ...     h = a * 2
    ...     y = torch.zeros(4, 8).index_add(0, torch.arange(64) % 4, h)  # keeps h only for its shape
    ...     _ = stage_boundary(h, consumers=y)
    ...     y.sum().backward()
    >>> stats.released_bytes
    2048
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_memkit.measure.storage import iter_tensors
from lightning_memkit.release.storage_release import (
    UnsafeReleaseError,
    call_site,
    holders_tuple,
    poison_enabled,
    poison_guard,
    release_storage,
    validate_tensor,
)

__all__ = ["stage_boundary", "release_stage_boundaries", "stage_boundaries_enabled", "BoundaryStats"]

ON_REFUSE = ("raise", "keep")


@dataclass
class BoundaryStats:
    """What a :func:`release_stage_boundaries` block did.

    Attributes:
        released: tensors released (poisoned, in poison mode).
        released_bytes: their storage bytes.
        kept: one message per refused release kept with ``on_refuse="keep"``.
        pending: marks whose consumers had not all run when the block ended (their hooks were removed).
        marks: :func:`stage_boundary` calls that ran inside the block (0: the model has no marks).
    """

    released: int = 0
    released_bytes: int = 0
    kept: list[str] = field(default_factory=list)
    pending: int = 0
    marks: int = 0


@dataclass(eq=False)
class _Mark:
    ref: weakref.ref
    on_refuse: str
    site: str
    min_seq: int | None
    held_by: tuple = ()
    waiting: set[int] = field(default_factory=set)
    handles: list[Any] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)


class _Session:
    def __init__(self, check: bool, poison: bool):
        self.check = check
        self.poison = poison
        self.stats = BoundaryStats()
        self.marks: list[_Mark] = []

    def release(self, mark: _Mark) -> None:
        for h in mark.handles:
            h.remove()
        mark.handles.clear()
        if mark in self.marks:
            self.marks.remove(mark)
        t = mark.ref()
        outputs, mark.outputs = mark.outputs, []
        if t is None:
            return
        try:
            n = release_storage(t, check=self.check, outputs=outputs, poison=self.poison,
                                min_seq=mark.min_seq, site=mark.site, held_by=mark.held_by)
        except UnsafeReleaseError as err:
            if mark.on_refuse == "raise":
                raise
            self.stats.kept.append(f"{mark.site}: {err}")
            return
        if n:
            self.stats.released += 1
            self.stats.released_bytes += n

    def close(self) -> None:
        for mark in self.marks:
            for h in mark.handles:
                h.remove()
        self.stats.pending = len(self.marks)
        self.marks.clear()


_LOCAL = threading.local()


def _sessions() -> list[_Session]:
    if not hasattr(_LOCAL, "sessions"):
        _LOCAL.sessions = []
    return _LOCAL.sessions


def stage_boundaries_enabled() -> bool:
    """Whether :func:`stage_boundary` marks are acted on in this thread now."""
    return bool(_sessions())


@contextmanager
def release_stage_boundaries(check: bool = True, poison: bool | None = None) -> Iterator[BoundaryStats]:
    """Act on :func:`stage_boundary` marks inside the block; yields its :class:`BoundaryStats`.

    Args:
        check: run the safety check of :func:`~lightning_memkit.memory.release_storage` on each release.
        poison: poison instead of freeing, and raise on any later read inside the block (default: the
            ``MEMKIT_POISON`` environment variable).

    On exit every hook still waiting for a consumer is removed; nothing outlives the block.
    """
    if not isinstance(check, bool):
        raise TypeError(f"release_stage_boundaries(check=...) must be a bool, got {type(check).__name__}")
    if poison is not None and not isinstance(poison, bool):
        raise TypeError(f"release_stage_boundaries(poison=...) must be None or a bool, got {type(poison).__name__}")
    session = _Session(check, poison_enabled() if poison is None else poison)
    stack = _sessions()
    with ExitStack() as guards:
        if session.poison:
            guards.enter_context(poison_guard())
        stack.append(session)
        try:
            yield session.stats
        finally:
            stack.remove(session)
            session.close()


def _consumers(consumers: Any) -> tuple[list[nn.Module], list[torch.Tensor] | None]:
    items = [consumers] if isinstance(consumers, (nn.Module, torch.Tensor)) else consumers
    if not isinstance(items, Sequence) or isinstance(items, str) or not items:
        raise TypeError("stage_boundary(consumers=...) must be a module, a tensor, or a non-empty list of modules "
                        f"or of tensors; got {type(consumers).__name__}")
    if all(isinstance(c, nn.Module) for c in items):
        if len({id(c) for c in items}) != len(items):
            raise ValueError("stage_boundary(consumers=...) lists a module twice; each consumer is waited for once")
        return list(items), None
    if all(isinstance(c, torch.Tensor) for c in items):
        return [], list(items)
    kinds = sorted({type(c).__name__ for c in items})
    raise TypeError(f"stage_boundary(consumers=...) must hold only modules or only tensors, got {kinds}")


def stage_boundary(
    t: torch.Tensor, consumers: Any, *, on_refuse: str = "raise", held_by: Any = ()
) -> torch.Tensor:
    """Mark ``t`` for release once its consumers have run; returns ``t`` (unchanged).

    Args:
        t: a stage output (an activation; not a parameter, a leaf that requires grad or a view).
        consumers: the module or modules that read ``t`` (released after each has run one forward), or
            the tensor or tensors they produced (released now).
        on_refuse: ``"raise"`` (default) raises when the check refuses; ``"keep"`` keeps the tensor and
            records the reason in :attr:`BoundaryStats.kept` (for a layer whose exchange may alias).
        held_by: a container (or several, in a tuple) that holds ``t`` but reads only its metadata, such as
            a schedule's list of stage outputs kept for a stage-wise backward (see ``release_storage``).

    Outside a :func:`release_stage_boundaries` block the arguments are validated and nothing else happens.
    """
    validate_tensor(t)
    modules, outputs = _consumers(consumers)
    if on_refuse not in ON_REFUSE:
        raise ValueError(f"stage_boundary(on_refuse={on_refuse!r}) is not allowed; allowed: {ON_REFUSE}")
    stack = _sessions()
    if not stack or t.numel() == 0:
        return t
    session = stack[-1]
    session.stats.marks += 1
    # consumers that run later create nodes numbered from here on; ones that already ran give no bound
    min_seq = torch._C._autograd._get_sequence_nr() if outputs is None else None
    mark = _Mark(weakref.ref(t), on_refuse, call_site(), min_seq, holders_tuple(held_by))
    session.marks.append(mark)
    if outputs is not None:
        mark.outputs = outputs
        session.release(mark)
        return t
    for m in modules:
        mark.waiting.add(id(m))

        def hook(module: nn.Module, args: Any, output: Any, mark: _Mark = mark) -> None:
            if id(module) not in mark.waiting:
                return
            mark.waiting.discard(id(module))
            mark.outputs.extend(iter_tensors(output))
            if not mark.waiting:
                session.release(mark)

        mark.handles.append(m.register_forward_hook(hook))
    return t
