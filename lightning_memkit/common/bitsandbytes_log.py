"""Keep bitsandbytes' import-time notice about its optional CPU kernel off the console.

On CPUs with AVX512-BF16, ``import bitsandbytes`` logs a warning when the optional ``kernels`` package (its faster
CPU 4-bit GEMM) is missing, on every import, in every process; bitsandbytes then runs its own CPU kernels, which
is what this package's CPU paths use anyway. :func:`drop_cpu_kernel_notice` adds a filter to that module's logger
that drops exactly this record; every other message of bitsandbytes is kept.

Example::

    >>> import logging
    >>> drop_cpu_kernel_notice()
    >>> logger = logging.getLogger(CPU_OPS_LOGGER)
    >>> def record(msg):
    ...     return logger.makeRecord(CPU_OPS_LOGGER, logging.WARNING, "ops.py", 1, msg, (), None)
    >>> logger.filter(record(NOTICE_PREFIX + ": No module named 'kernels'")), logger.filter(record("other"))
    (False, True)
"""

from __future__ import annotations

import logging

__all__ = ["CPU_OPS_LOGGER", "NOTICE_PREFIX", "drop_cpu_kernel_notice"]

CPU_OPS_LOGGER = "bitsandbytes.backends.cpu.ops"
NOTICE_PREFIX = "Failed to load CPU gemm_4bit_forward from kernels-community"


class _DropNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(NOTICE_PREFIX)


def drop_cpu_kernel_notice() -> None:
    """Install the filter once (before bitsandbytes is imported for it to take effect)."""
    logger = logging.getLogger(CPU_OPS_LOGGER)
    if not any(isinstance(f, _DropNotice) for f in logger.filters):
        logger.addFilter(_DropNotice())
