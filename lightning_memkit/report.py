"""The end-of-fit memory report: what each active memkit feature measurably did, one line each.

Every memkit callback, the precision plugin and the pipeline strategy record while they run what they
did to memory and say it, in bytes, through a ``memory_effect() -> str`` method (a feature that did
nothing says so). :func:`memory_effects` collects those lines from a trainer (its callbacks, its
precision plugin and its strategy); :class:`~lightning_memkit.callbacks.PeakMemoryMonitor` prints them
with its step-peak table at the end of training, and the ``memkit`` command adds them to its report.
The static side (bytes of parameters, gradients and optimizer state per module) is
:func:`~lightning_memkit.memory.report.static_memory_table`.

Example::

    >>> from types import SimpleNamespace
    >>> from lightning_memkit.callbacks import StageBoundaryRelease
    >>> from lightning_memkit.report import memory_effects
    >>> trainer = SimpleNamespace(callbacks=[StageBoundaryRelease()], precision_plugin=None, strategy=None)
    >>> memory_effects(trainer)
    ['StageBoundaryRelease: no stage_boundary release ran (no marked tensor in the training steps)']
"""

from __future__ import annotations

from typing import Any

__all__ = ["memory_effects", "feature_owners"]


def feature_owners(trainer: Any) -> list[Any]:
    """The memkit objects of ``trainer`` that report a memory effect: callbacks, precision plugin, strategy."""
    candidates = [*getattr(trainer, "callbacks", []), getattr(trainer, "precision_plugin", None),
                  getattr(trainer, "strategy", None)]
    return [obj for obj in candidates
            if obj is not None and type(obj).__module__.startswith("lightning_memkit.")
            and callable(getattr(obj, "memory_effect", None))]


def memory_effects(trainer: Any) -> list[str]:
    """One line per active memkit feature of ``trainer``: what it measurably did to memory, in bytes."""
    return [owner.memory_effect() for owner in feature_owners(trainer)]
