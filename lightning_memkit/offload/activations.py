"""Move what backward needs from chosen blocks to host memory as it is made; bring it back ahead of backward.

:func:`offload_activations` hooks each chosen block (a forward pre-hook and an ``always_call`` forward hook; the
module's ``forward`` is left alone) so that its call runs under
:class:`torch.autograd.graph.saved_tensors_hooks`: each tensor autograd saves in the block is copied to host
memory and the device tensor is let go; backward gets a device copy back. Gradients are bitwise those of the run
without it. The hooks sit around whatever ``forward`` is, so the order of composition with
:func:`~lightning_memkit.recompute.activation_recompute.checkpoint_modules` does not matter: with the block
checkpointed, what it saves is only its inputs, and those are offloaded (offloaded checkpointing); without, every
activation it saves is. Without grad mode (validation, ``no_grad``) nothing happens.

What is never offloaded: parameters and buffers of the blocks (and of ``root``) and views of them (same storage),
tensors smaller than ``min_bytes``, tensors not on CPU or CUDA, tensor subclasses, tensors whose elements overlap
(``expand``); a tensor saved twice in one block call (same storage, offset, shape, strides, dtype, version) gets
one host copy. Host copies are made inside :func:`~lightning_memkit.measure.live_peak.host_memory`, so
:class:`~lightning_memkit.memory.LivePeak` counts them under ``"host"``, apart from the device bytes. The packed
object autograd keeps holds the only reference to its host copy, which is freed with the saved tensor.

CUDA: host buffers are pinned and the copies run on a side stream (one per device), ordered by events;
``record_stream`` keeps the allocator from reusing a device storage before its copy is done. With ``prefetch``,
the first tensor of block ``i`` that backward unpacks starts the host-to-device copies of the rest of block ``i``
and of block ``i - 1`` (the next one backward needs) on the side stream; an unpack waits only for its own copy.
On CPU and on fake tensors (the estimator's ``FakeTensorMode``) copies are plain and synchronous, no stream, no
pinning: unpack makes a new tensor, so the accounting is symmetric.

Example::

    >>> import torch
    >>> from lightning_memkit.memory import LivePeak
    >>> net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(3)])
    >>> x = torch.randn(32, 64, requires_grad=True)
    >>> with offload_activations([("1", net[1])], root=net) as handle, LivePeak() as lp:
    ...     net(x).sum().backward()
    ...     handle.names
    ['1']
    >>> stats = handle.stats()
    >>> stats.tensors, stats.bytes, lp.host_peak_bytes   # block 1's input and its tanh output: 32 x 64 float32 each
    (2, 16384, 16384)
    >>> handle.names   # restored: the hooks are gone
    []
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from lightning_memkit.measure.live_peak import host_memory
from lightning_memkit.measure.storage import has_storage, may_overlap, storage_key
from lightning_memkit.recompute.activation_recompute import repeated_blocks

__all__ = ["OffloadHandle", "OffloadStats", "is_offloaded", "offload_activations", "offload_blocks"]

_OFFLOADED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules hooked by some handle now
_DEVICES = ("cpu", "cuda")


@dataclass
class OffloadStats:
    """What a handle offloaded since its last :meth:`OffloadHandle.reset_stats`.

    Attributes:
        tensors: host copies made.
        bytes: their bytes.
        host_live_bytes: bytes of this handle's host copies alive now (whenever they were made).
        host_peak_bytes: the most of those alive at once since the reset.
    """

    tensors: int = 0
    bytes: int = 0
    host_live_bytes: int = 0
    host_peak_bytes: int = 0


class _Counter:
    """The handle's counts; host copies subtract themselves when they die (the backward thread, the collector)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # a host copy may die (and count itself out) while this thread holds it
        self.stats = OffloadStats()

    def made(self, nbytes: int) -> None:
        with self.lock:
            s = self.stats
            s.tensors, s.bytes, s.host_live_bytes = s.tensors + 1, s.bytes + nbytes, s.host_live_bytes + nbytes
            s.host_peak_bytes = max(s.host_peak_bytes, s.host_live_bytes)

    def freed(self, nbytes: int) -> None:
        with self.lock:
            self.stats.host_live_bytes -= nbytes


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its span exactly (any order of strides): then its layout is copied as it is."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 1)
    return span == t.numel()


def _real_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and not isinstance(t, FakeTensor)


class _Packed:
    """What autograd keeps for one offloaded tensor: its host copy and how to bring it back.

    ``copied``: the event after the device-to-host copy (CUDA); ``ready``/``ready_event``: a device copy
    fetched ahead (prefetch) and its event; ``last``: the device copy handed out last, reused while alive.
    """

    __slots__ = ("host", "shape", "stride", "device", "frame", "counter", "stream", "copied", "ready", "ready_event",
                 "last", "__weakref__")

    def __init__(self, t: torch.Tensor, frame: _Frame, stream: Any) -> None:
        self.shape, self.stride, self.device = tuple(t.shape), t.stride(), t.device
        self.frame, self.counter, self.stream = frame, frame.counter, stream
        self.copied = self.ready = self.ready_event = self.last = None
        src = t.detach()
        pin = stream is not None
        with torch.no_grad(), host_memory():
            if _dense(t):  # the same strides: backward reads the layout it would have read
                host = torch.empty_strided(self.shape, self.stride, dtype=t.dtype, device="cpu", pin_memory=pin)
            else:  # a view with gaps: only its elements, compact; brought back in its own strides
                host = torch.empty(self.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            if stream is None:
                host.copy_(src)
            else:
                stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written on the current stream
                with torch.cuda.stream(stream):
                    host.copy_(src, non_blocking=True)
                    self.copied = stream.record_event()
                src.record_stream(stream)  # its storage is not reused before the copy is done
        self.host = host
        self.counter.made(host.untyped_storage().nbytes())

    def __del__(self) -> None:
        host = getattr(self, "host", None)
        if host is not None:
            self.counter.freed(host.untyped_storage().nbytes())

    def fetch(self) -> None:
        """Start the host-to-device copy on the side stream (CUDA; a no-op elsewhere or when started already)."""
        if self.stream is None or self.ready is not None:
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.copied)
            dev = torch.empty_strided(self.shape, self.stride, dtype=self.host.dtype, device=self.device)
            dev.copy_(self.host, non_blocking=True)
            self.ready_event = self.stream.record_event()
        self.ready = dev

    def unpack(self) -> torch.Tensor:
        last = self.last() if self.last is not None else None
        if last is not None:  # saved twice, or a second backward (retain_graph) while the first copy lives
            return last
        self.frame.start()
        if self.stream is None:
            dev = torch.empty_strided(self.shape, self.stride, dtype=self.host.dtype, device=self.device)
            with torch.no_grad():
                dev.copy_(self.host)
        else:
            self.fetch()
            dev, event, self.ready, self.ready_event = self.ready, self.ready_event, None, None
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            dev.record_stream(current)  # made on the side stream, used and freed on this one
        self.last = weakref.ref(dev)
        return dev


def _unpack(packed: Any) -> torch.Tensor:
    return packed.unpack() if isinstance(packed, _Packed) else packed


class _Frame:
    """One call of one block: what it offloaded (held weakly), its dedup table while it runs, the call before it."""

    __slots__ = ("handle", "counter", "kept", "cache", "items", "prev", "started", "__weakref__")

    def __init__(self, handle: OffloadHandle, kept: tuple[set[int], ...], prev: weakref.ref | None) -> None:
        self.handle, self.counter, self.kept, self.prev = handle, handle._counter, kept, prev
        self.cache: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}
        self.items: list[weakref.ref] = []
        self.started = False

    def pack(self, t: torch.Tensor) -> Any:
        if not self.handle._offloadable(t, self.kept):
            return t
        key = (storage_key(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        hit = self.cache.get(key)
        if hit is not None and hit[0]() is not None:
            packed = hit[1]()
            if packed is not None:
                return packed
        packed = _Packed(t, self, self.handle._stream(t))
        self.cache[key] = (weakref.ref(t.untyped_storage()), weakref.ref(packed))
        self.items.append(weakref.ref(packed))
        return packed

    def close(self) -> None:
        self.cache.clear()
        self.kept = ()

    def fetch_all(self) -> None:
        for ref in self.items:
            packed = ref()
            if packed is not None:
                packed.fetch()

    def start(self) -> None:
        """Backward reached this block: with prefetch, fetch its tensors and the previous block's."""
        if self.started:
            return
        self.started = True
        if not self.handle.prefetch:
            return
        self.fetch_all()
        prev = self.prev() if self.prev is not None else None
        if prev is not None:
            prev.fetch_all()


class OffloadHandle:
    """The hooked blocks (held weakly) and the offload counts; :meth:`restore` or leaving the ``with`` block unhooks.

    Attributes:
        min_bytes: tensors smaller than this stay where they are.
        prefetch: fetch the next block's tensors ahead of backward (CUDA).
    """

    def __init__(self, *, min_bytes: int = 1024, prefetch: bool = True, root: nn.Module | None = None) -> None:
        _check_args(min_bytes, prefetch, root)
        self.min_bytes, self.prefetch = min_bytes, prefetch
        self._root = weakref.ref(root) if root is not None else None
        self._hooked: list[tuple[str, weakref.ref, list[Any]]] = []
        self._counter = _Counter()
        self._local = threading.local()  # .open: the frames of the block calls running in this thread
        self._last: weakref.ref | None = None  # the latest block call that offloaded something
        self._kept: set[int] = set()  # storages of the root's and the blocks' parameters and buffers
        self._streams: dict[torch.device, Any] = {}

    @property
    def names(self) -> list[str]:
        return [name for name, ref, _ in self._hooked if ref() is not None]

    def stats(self) -> OffloadStats:
        """A copy of the counts since the last :meth:`reset_stats`."""
        with self._counter.lock:
            s = self._counter.stats
            return OffloadStats(s.tensors, s.bytes, s.host_live_bytes, s.host_peak_bytes)

    def reset_stats(self) -> None:
        """Start counting anew (a step): tensors and bytes from zero, the host peak from the bytes alive now."""
        with self._counter.lock:
            s = self._counter.stats
            s.tensors, s.bytes, s.host_peak_bytes = 0, 0, s.host_live_bytes

    def add(self, modules: Iterable[tuple[str, nn.Module]]) -> None:
        """Hook more blocks (all validated first: nothing is hooked if one is hooked already)."""
        items = list(modules)
        for name, module in items:
            if not isinstance(module, nn.Module):
                raise TypeError(f"module {name!r} must be a torch.nn.Module, got {type(module).__name__}")
            if module in _OFFLOADED:
                raise ValueError(f"module {name!r} ({type(module).__name__}) already offloads its activations")
        if len({id(m) for _, m in items}) != len(items):
            raise ValueError("modules: the same module is given twice")
        for name, module in items:
            hooks = [module.register_forward_pre_hook(self._enter),
                     module.register_forward_hook(self._leave, always_call=True, prepend=True)]
            _OFFLOADED.add(module)
            self._hooked.append((name, weakref.ref(module), hooks))

    def restore(self) -> None:
        """Remove every hook (latest first). Tensors offloaded already still come back in backward."""
        while self._hooked:
            _name, ref, hooks = self._hooked.pop()
            for h in hooks:
                h.remove()
            module = ref()
            if module is not None:
                _OFFLOADED.discard(module)

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    def __len__(self) -> int:
        return len(self.names)

    # -- the hooks -------------------------------------------------------------------------------------------------
    def _enter(self, module: nn.Module, _args: Any) -> None:
        stack = self._local.__dict__.setdefault("open", [])
        if not torch.is_grad_enabled():
            stack.append((id(module), None, None))
            return
        if not self._kept or (self._hooked and self._hooked[0][1]() is module):  # once per forward pass
            self._kept = self._kept_storages()
        own = {storage_key(t) for t in (*module.parameters(), *module.buffers()) if has_storage(t)}
        frame = _Frame(self, (self._kept, own), self._last)
        hooks = torch.autograd.graph.saved_tensors_hooks(frame.pack, _unpack)
        hooks.__enter__()
        stack.append((id(module), hooks, frame))

    def _leave(self, module: nn.Module, _args: Any, _out: Any) -> None:
        stack = self._local.__dict__.get("open")
        if not stack or stack[-1][0] != id(module):  # a pre-hook before ours raised: ours never ran
            return
        _, hooks, frame = stack.pop()
        if hooks is None:
            return
        hooks.__exit__(None, None, None)
        frame.close()
        if frame.items:
            self._last = weakref.ref(frame)

    def _kept_storages(self) -> set[int]:
        modules = [ref() for _, ref, _ in self._hooked]
        root = self._root() if self._root is not None else None
        tensors = [t for m in (root, *modules) if m is not None for t in (*m.parameters(), *m.buffers())]
        return {storage_key(t) for t in tensors if has_storage(t)}

    def _offloadable(self, t: torch.Tensor, kept: tuple[set[int], ...]) -> bool:
        if type(t) is not torch.Tensor and type(t) is not FakeTensor or isinstance(t, nn.Parameter):
            return False  # a subclass (quantized, distributed) knows its own storage; a parameter stays
        if t.device.type not in _DEVICES or t.numel() * t.element_size() < max(self.min_bytes, 1):
            return False
        if t.is_inference() or not has_storage(t) or may_overlap(t):
            return False
        key = storage_key(t)
        return not any(key in keys for keys in kept)

    def _stream(self, t: torch.Tensor) -> Any:
        """The side stream of ``t``'s CUDA device (made once), or ``None`` (CPU, fake tensors)."""
        if not _real_cuda(t):
            return None
        stream = self._streams.get(t.device)
        if stream is None:
            stream = self._streams[t.device] = torch.cuda.Stream(device=t.device)
        return stream


def _check_args(min_bytes: Any, prefetch: Any, root: Any) -> None:
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int):
        raise TypeError(f"offload_activations(min_bytes=...) must be an int >= 0, got {type(min_bytes).__name__}")
    if min_bytes < 0:
        raise ValueError(f"offload_activations(min_bytes={min_bytes}) must be an int >= 0")
    if not isinstance(prefetch, bool):
        raise TypeError(f"offload_activations(prefetch=...) must be a bool, got {type(prefetch).__name__}")
    if root is not None and not isinstance(root, nn.Module):
        raise TypeError(f"offload_activations(root=...) must be a torch.nn.Module or None, got {type(root).__name__}")


def offload_activations(
    modules: Iterable[tuple[str, nn.Module]] | Iterable[nn.Module], *, min_bytes: int = 1024, prefetch: bool = True,
    root: nn.Module | None = None,
) -> OffloadHandle:
    """Offload what each given block saves for backward to host memory; returns the handle that unhooks them.

    ``modules`` are ``(name, module)`` pairs (as :func:`~lightning_memkit.memory.select_modules` returns) or bare
    modules (named ``"0"``, ``"1"``, ...). ``root``: the whole model, whose parameters and buffers (a tied
    embedding, a shared table) are never offloaded either; the blocks' own never are. ``min_bytes``: smaller
    tensors stay. ``prefetch``: on CUDA, bring the next block's tensors back ahead of backward.
    """
    pairs = [item if isinstance(item, tuple) else (str(i), item) for i, item in enumerate(modules)]
    handle = OffloadHandle(min_bytes=min_bytes, prefetch=prefetch, root=root)
    handle.add(pairs)
    return handle


def offload_blocks(model: nn.Module, *, min_bytes: int = 1024, prefetch: bool = True) -> OffloadHandle:
    """:func:`offload_activations` on ``model``'s repeated blocks (:func:`~lightning_memkit.recompute.
    activation_recompute.repeated_blocks`), ``model`` as root: a patch for ``estimate_training_memory(patches=[...])``.

    Raises ``ValueError`` when the model has no ``nn.ModuleList`` of same-class blocks.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload_blocks(model=...) must be a torch.nn.Module, got {type(model).__name__}")
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(f"offload_blocks: {type(model).__name__} has no nn.ModuleList of same-class blocks; call "
                         "offload_activations with the modules to offload")
    return offload_activations(blocks, min_bytes=min_bytes, prefetch=prefetch, root=model)


def is_offloaded(module: nn.Module) -> bool:
    """Whether ``module`` is hooked by an :class:`OffloadHandle` now."""
    return module in _OFFLOADED
