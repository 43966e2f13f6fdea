"""Refusals before slow work: a callback that can tell at ``setup`` that the fit will fail (``ExportAdapters`` on a
model without adapters) defines ``preflight(trainer, pl_module)``, raising ``ValueError``; :func:`run_preflights`
calls every one on the Trainer. ``memkit fit`` runs them before the fit starts, so the refusal comes before any other
work whatever order the callbacks are listed in (Lightning calls their ``setup`` in list order: a callback whose
``setup`` is slow, such as ``MemoryBudget``'s planning, runs them first to do the same for a plain ``Trainer``).

Example::

    >>> from types import SimpleNamespace
    >>> from lightning import Callback
    >>> class Refuses(Callback):
    ...     def preflight(self, trainer, pl_module):
    ...         raise ValueError("Refuses: nothing to do")
    >>> run_preflights(SimpleNamespace(callbacks=[Callback(), Refuses()]), None)  # a Trainer's callbacks
    Traceback (most recent call last):
    ...
    ValueError: Refuses: nothing to do
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_preflights"]


def run_preflights(trainer: Any, pl_module: Any) -> None:
    """Call ``preflight(trainer, pl_module)`` of every callback on ``trainer`` that defines one, in the Trainer's
    order; their ``ValueError`` propagates."""
    for callback in list(trainer.callbacks):
        check = getattr(callback, "preflight", None)
        if callable(check):
            check(trainer, pl_module)
