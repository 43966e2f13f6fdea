"""The peak of new bytes the allocator hands out while a block runs: also inside ``torch.compile``d code.

:class:`~lightning_memkit.memory.LivePeak` counts storages through a dispatch mode, and under an active
dispatch mode ``torch.compile`` does not run its compiled graphs (dynamo falls back to eager), so LivePeak
measures the eager step, never the compiled one. :class:`AllocatorPeak` counts at the allocator instead:
on CUDA the ``max_memory_allocated`` delta; on CPU the allocation and free events of the CPU allocator,
recorded by ``torch.profiler`` with ``profile_memory=True`` (the buffers inductor's kernels allocate
included). Blocks allocated before the block and freed in it are not subtracted (the CPU allocator does
not know their size; it warns once), so, as with LivePeak, only what the block creates counts. On eager
CPU code both agree to the byte.

Example::

    >>> import torch
    >>> from lightning_memkit.measure.allocator_peak import AllocatorPeak
    >>> with AllocatorPeak("cpu") as ap:
    ...     a = torch.empty(1024, dtype=torch.float32)   # 4 KiB
    ...     b = torch.empty(2048, dtype=torch.uint8)     # 2 KiB
    ...     del a
    >>> ap.peak_bytes
    6144
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["AllocatorPeak"]


class AllocatorPeak:
    """Context manager: ``peak_bytes`` is the high-water mark of bytes allocated on ``device`` inside the block.

    ``device``: ``"cpu"`` or a CUDA device. A second ``torch.profiler`` session cannot run at the same time
    as the CPU one (the profiler refuses nested sessions).
    """

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"AllocatorPeak(device={str(self.device)!r}): only 'cpu' and 'cuda' devices are supported")
        self.peak_bytes = 0
        self._profiler: Any = None
        self._base = 0

    def __enter__(self) -> AllocatorPeak:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            )
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        self._profiler.__exit__(*exc)
        if exc[0] is None:
            self.peak_bytes = _running_peak(self._profiler.profiler.kineto_results.events())
        self._profiler = None


def _running_peak(events: Any) -> int:
    """The highest running sum of the CPU allocator's ``[memory]`` events (allocations +, frees -)."""
    memory = sorted((e.start_ns(), e.nbytes()) for e in events
                    if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
    live = peak = 0
    for _, nbytes in memory:
        live += nbytes
        peak = max(peak, live)
    return peak
