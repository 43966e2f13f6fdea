"""Helpers shared by the benchmark modules: timing, machine description, result records."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable

import torch

from lightning_memkit.memory import LivePeak


def machine(device: str = "cpu") -> str:
    """One line naming the machine the numbers came from."""
    if device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_once(fn: Callable[[], object], device: str = "cpu") -> float:
    """Wall time of one ``fn()`` in seconds, the device synchronized before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def timed(fn: Callable[[], object], *, device: str = "cpu", repeat: int = 3, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds."""
    for _ in range(warmup):
        fn()
    times = sorted(time_once(fn, device) for _ in range(repeat))
    return times[len(times) // 2]


def peak_of(fn: Callable[[], object], *, device: str = "cpu") -> int:
    """Peak bytes of new storage while ``fn()`` runs (``max_memory_allocated`` delta on CUDA)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        return peak
    with LivePeak() as lp:
        out = fn()
        del out
    return lp.peak_bytes


def record(benchmark: str, case: str, baseline: str, rows: list[dict], goal: str = "", met=None) -> dict:
    """A result entry: ``rows`` are one dict per implementation (``impl`` plus metric columns)."""
    return {"benchmark": benchmark, "case": case, "baseline": baseline, "rows": rows, "goal": goal, "met": met}


def mib(n: int | float) -> float:
    return round(n / 2**20, 2)
