"""Give memory back between phases.

Two tools for the moment a phase (fit, validate, test, a fold of a sweep) is over (the third,
:func:`~lightning_memkit.memory.find_referrers`, which names what still holds memory, lives in
:mod:`lightning_memkit.release.referrers`):

- :func:`release_optimizer_state` empties an optimizer's ``state`` in place, so every holder of the
  optimizer (a wrapper, a scheduler, the model through its trainer) sees it empty at once.
- :func:`empty_device_cache` runs the garbage collector and hands cached allocator blocks back to the
  driver (CUDA, XPU, MPS).

Example::

    >>> import torch
    >>> from lightning_memkit.memory import empty_device_cache, release_optimizer_state
    >>> model = torch.nn.Linear(256, 256)
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> model(torch.randn(4, 256)).sum().backward()
    >>> opt.step()
    >>> release_optimizer_state(opt)  # exp_avg, exp_avg_sq and step of weight and bias
    526344
    >>> empty_device_cache("cpu")     # nothing cached on CPU
    0
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch

from lightning_memkit.measure.storage import storage_key, storage_of, tensors_in

__all__ = ["release_optimizer_state", "empty_device_cache"]


# -- optimizer state --------------------------------------------------------------------------------
def storage_refs(obj: Any, skip: set[int]) -> dict[int, tuple[weakref.ref, int]]:
    refs: dict[int, tuple[weakref.ref, int]] = {}
    for t in tensors_in(obj, max_depth=5, attributes=False):
        s = storage_of(t)
        if s is not None and storage_key(s) not in skip and storage_key(s) not in refs:
            refs[storage_key(s)] = (weakref.ref(s), s.nbytes())
    return refs


def release_optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    """Clear ``optimizer.state`` in place and return the bytes of state storage that this freed.

    The dict object itself is emptied (not replaced), so a Lightning ``LightningOptimizer``, an LR
    scheduler or anything else that shares it sees the empty state. Parameters are never touched, and
    the optimizer stays usable: the next ``step()`` rebuilds its state from zero, as for a new optimizer.
    The returned count is exact: storages still held elsewhere after the clear are not counted.

    Example::

        >>> import torch
        >>> from lightning_memkit.memory import release_optimizer_state
        >>> p = torch.nn.Parameter(torch.zeros(1024))
        >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> p.grad = torch.ones(1024)
        >>> opt.step()
        >>> release_optimizer_state(opt), len(opt.state)
        (4096, 0)
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    state = optimizer.state
    if not isinstance(state, dict):
        raise TypeError(f"optimizer.state must be a dict, got {type(state).__name__}")
    params = {storage_key(p) for g in optimizer.param_groups for p in g["params"] if storage_of(p) is not None}
    refs = storage_refs(list(state.values()), params)
    state.clear()
    return sum(n for ref, n in refs.values() if ref() is None)


# -- device cache -----------------------------------------------------------------------------------
def _reserved(kind: str, index: int | None) -> int | None:
    if kind == "cuda":
        return torch.cuda.memory_reserved(index)
    if kind == "xpu":
        return torch.xpu.memory_reserved(index)
    if kind == "mps":
        fn = getattr(torch.mps, "driver_allocated_memory", None)
        return int(fn()) if fn is not None else None
    return None


def _accelerators(device: torch.device | str | None) -> list[tuple[str, int | None]]:
    if device is not None:
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda", "xpu", "mps"):
            raise ValueError(f"device={str(dev)!r} is not supported; allowed: cpu, cuda, xpu, mps or None (all)")
        if dev.type == "cpu":
            return []
        mod = getattr(torch, dev.type)
        if not (mod.is_available() if dev.type != "mps" else torch.backends.mps.is_available()):
            return []
        if dev.type == "mps":
            return [("mps", None)]
        return [(dev.type, dev.index if dev.index is not None else mod.current_device())]
    found: list[tuple[str, int | None]] = []
    for kind in ("cuda", "xpu"):
        mod = getattr(torch, kind, None)
        if mod is not None and mod.is_available() and (kind != "cuda" or torch.cuda.is_initialized()):
            found += [(kind, i) for i in range(mod.device_count())]
    if torch.backends.mps.is_available():
        found.append(("mps", None))
    return found


def empty_device_cache(device: torch.device | str | None = None) -> int:
    """Collect garbage, then return cached allocator blocks to the driver; returns the bytes given back.

    ``device=None`` covers every initialised CUDA/XPU device and MPS; ``"cuda:1"`` only that card. The
    count is the drop in reserved memory (``torch.cuda.memory_reserved`` and its XPU/MPS equivalents);
    on CPU there is no cache and the result is 0.

    Example::

        >>> from lightning_memkit.memory import empty_device_cache
        >>> empty_device_cache("cpu")
        0
    """
    gc.collect()
    freed = 0
    for kind, index in _accelerators(device):
        if kind == "cuda":
            with torch.cuda.device(index):
                torch.cuda.synchronize()
                before = _reserved(kind, index)
                torch.cuda.empty_cache()
        elif kind == "xpu":
            torch.xpu.synchronize(index)
            before = _reserved(kind, index)
            torch.xpu.empty_cache()
        else:
            torch.mps.synchronize()
            before = _reserved(kind, index)
            torch.mps.empty_cache()
        after = _reserved(kind, index)
        if before is not None and after is not None:
            freed += max(0, before - after)
    return freed
