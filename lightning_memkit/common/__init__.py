"""What every folder shares: argument checks with one message format, progress of long work, and names a package
exports but imports on first access (:func:`lazy_exports`)."""

from lightning_memkit.common.lazy import lazy_exports
from lightning_memkit.common.progress import WorkProgress, progress_enabled
from lightning_memkit.common.validation import (
    ArgumentTypeError,
    check_bool,
    check_choice,
    check_int,
    check_multiple,
    check_number,
)

__all__ = ["ArgumentTypeError", "WorkProgress", "check_bool", "check_choice", "check_int", "check_multiple",
           "check_number", "lazy_exports", "progress_enabled"]
