"""What every folder shares: argument checks with one message format, and progress of long work."""

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
           "check_number", "progress_enabled"]
