"""Create the meta-device tensors of a module on a real device, and recompute those no checkpoint holds.

A model built under ``torch.device("meta")`` has no data. A checkpoint fills what ``state_dict()`` lists;
non-persistent buffers (a rotary embedding's ``inv_freq``, say) are in no checkpoint and must be computed
again, as the model's own ``__init__`` did. This module finds them, allocates them on the device and hands
them to a caller-supplied ``init_buffers(module, names)`` (transformers models:
:func:`lightning_memkit.hf.meta_init.init_hf_buffers`), checking that every one was written and putting
the meta tensors back if anything fails. Tied tensors (one object under several names) stay tied.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from lightning_memkit.loading.meta_buffers import initialize_meta_buffers, meta_buffer_names
    >>> with torch.device("meta"):
    ...     m = nn.Module()
    ...     m.register_buffer("scale", torch.empty(3), persistent=False)
    >>> names = meta_buffer_names(m)
    >>> names
    ['scale']
    >>> initialize_meta_buffers(m, names, "cpu", lambda mod, names: mod.scale.fill_(2.0))
    >>> m.scale.tolist()
    [2.0, 2.0, 2.0]
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

__all__ = ["BufferInit", "meta_buffer_names", "meta_tensor_names", "initialize_meta_buffers"]

BufferInit = Callable[[nn.Module, list[str]], object]
Locations = dict[int, list[tuple[nn.Module, str, str]]]


def tensor_locations(module: nn.Module) -> Locations:
    """Every (submodule, store, name) holding each tensor object, so tied tensors stay tied."""
    locs: Locations = defaultdict(list)
    for sub in module.modules():
        for store in ("_parameters", "_buffers"):
            for name, t in getattr(sub, store).items():
                if t is not None:
                    locs[id(t)].append((sub, store, name))
    return locs


def materialize(old: torch.Tensor, device: torch.device, locs: Locations) -> torch.Tensor:
    """An uninitialised ``old`` on ``device`` (a Parameter stays one), put in every place that held ``old``."""
    data = torch.empty(old.shape, dtype=old.dtype, device=device)
    new = nn.Parameter(data, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else data
    _put(locs.get(id(old), ()), new)
    return new


def _put(places: Iterable[tuple[nn.Module, str, str]], tensor: torch.Tensor) -> None:
    for sub, store, name in places:
        getattr(sub, store)[name] = tensor


def meta_tensor_names(module: nn.Module) -> list[str]:
    """Names of the parameters and buffers of ``module`` still on the meta device (tied ones once)."""
    named = list(module.named_parameters()) + list(module.named_buffers())
    return [name for name, t in named if t.is_meta]


def meta_buffer_names(module: nn.Module) -> list[str]:
    """Meta-device buffers that ``module.state_dict()`` does not list (non-persistent ones)."""
    listed = {id(t) for t in module.state_dict(keep_vars=True).values()}
    return [name for name, t in module.named_buffers() if t.is_meta and id(t) not in listed]


def _poison(t: torch.Tensor) -> None:
    """Fill a fresh buffer with a value an init would not leave: NaN, or the lowest integer."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


def _unwritten(t: torch.Tensor) -> bool:
    """Whether ``t`` still holds what :func:`_poison` put there (any NaN; every integer at its minimum)."""
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(torch.isnan(t).any())
    return bool((t == torch.iinfo(t.dtype).min).all())


def _check_written(module: nn.Module, names: Sequence[str]) -> None:
    for name in names:
        owner, _, attr = name.rpartition(".")
        t = (module.get_submodule(owner) if owner else module)._buffers.get(attr)
        if t is None or t.is_meta:
            raise ValueError(f"{name}: init_buffers left it {'unset' if t is None else 'on the meta device'}")
        if _unwritten(t):
            raise ValueError(f"{name}: init_buffers did not write it (it still holds the NaN or lowest integer it was "
                             "allocated with)")


def initialize_meta_buffers(module: nn.Module, names: Sequence[str], device: torch.device | str,
                            init_buffers: BufferInit) -> None:
    """Allocate the meta buffers ``names`` on ``device`` and call ``init_buffers(module, list(names))`` to fill them.

    Every buffer must be real and written afterwards (``ValueError`` naming it otherwise). If ``init_buffers``
    or that check fails, every buffer is put back as it was (on meta) and the error propagates.
    """
    if not names:
        return
    locs = tensor_locations(module)
    old = [module.get_buffer(name) for name in names]
    places = [list(locs.get(id(t), ())) for t in old]
    try:
        done: dict[int, torch.Tensor] = {}
        for t in old:
            if id(t) not in done:
                done[id(t)] = materialize(t, torch.device(device), locs)
                _poison(done[id(t)])
        init_buffers(module, list(names))
        _check_written(module, names)
    except BaseException:
        for t, where in zip(old, places):
            _put(where, t)
        raise
