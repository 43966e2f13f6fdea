"""Progress of long one-off work (checkpoint loads, planning runs, measurement passes): one log line per item.

Every long piece of work in the package reports through :class:`WorkProgress`: one ``INFO`` line on the
``lightning_memkit`` logger per finished item, ``"<what>: <n>/<total> <item>"``, so that progress shows
in terminals, in log files and under any logging setup alike. Inside a Trainer the work reports only
where :func:`progress_enabled` says so: global rank 0, the trainer's progress bar on, and standard error
a terminal (a batch job's log stays quiet).

Example::

    >>> from lightning_memkit.common.progress import WorkProgress
    >>> progress = WorkProgress("loading model.safetensors", total=2)
    >>> progress.step("embed.weight")  # INFO: "loading model.safetensors: 1/2 embed.weight"
    >>> progress.step("head.weight")   # INFO: "loading model.safetensors: 2/2 head.weight"
    >>> progress.done, WorkProgress("quiet", total=1, enabled=False).enabled
    (2, False)
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from lightning_memkit.common.validation import check_bool, check_int

__all__ = ["WorkProgress", "progress_enabled"]

log = logging.getLogger("lightning_memkit.common.progress")


def _stderr_is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def progress_enabled(trainer: Any, *, require_terminal: bool = True) -> bool:
    """Whether work inside ``trainer`` reports progress: global rank 0, its progress bar on, stderr a terminal.

    ``require_terminal=False`` drops the terminal condition (for progress the user asked for explicitly).
    """
    if not getattr(trainer, "is_global_zero", True) or getattr(trainer, "progress_bar_callback", None) is None:
        return False
    return _stderr_is_terminal() or not require_terminal


class WorkProgress:
    """Counts finished items of one piece of work and logs each (``enabled=False``: counts silently).

    Args:
        what: the work, e.g. ``"loading model.safetensors"``.
        total: number of items, or ``None`` when it is not known in advance (lines then read ``n/?``).
        enabled: log the lines.
    """

    def __init__(self, what: str, total: int | None = None, enabled: bool = True):
        if not isinstance(what, str) or not what:
            raise TypeError(f"WorkProgress(what=...) must be a non-empty str, got {what!r}")
        self.what = what
        self.total = check_int(total, "total", minimum=0, allow_none=True, owner="WorkProgress")
        self.enabled = check_bool(enabled, "enabled", owner="WorkProgress")
        self.done = 0

    def step(self, item: str = "") -> None:
        """One more item finished; ``item`` names it in the line."""
        self.done += 1
        if self.enabled:
            total = "?" if self.total is None else self.total
            log.info("%s: %d/%s%s", self.what, self.done, total, f" {item}" if item else "")
