"""Decide whether a loader's allocator warmup fits the device, and skip or cap it while weights load.

Hugging Face transformers' ``caching_allocator_warmup`` (in ``transformers.modeling_utils``) reserves one
block the size of the whole model before ``from_pretrained(..., device_map=...)`` copies the weights. On a
card with a per-process memory fraction, or one shared with other processes, that single block can fail
although the load itself would fit. :func:`guard_allocator_warmup` wraps the warmup function while it is
active and, per call, runs it unchanged (``on``), skips it (``off``, or ``auto`` below a threshold) or
runs it with its block capped to what the device can still give this process (``cap``).

Example::

    >>> from lightning_memkit.memory import guard_allocator_warmup, warmup_decision
    >>> warmup_decision("cpu", mode="off").skip
    True
    >>> with guard_allocator_warmup(mode="auto"):       # a no-op when transformers is not installed
    ...     pass  # model = AutoModelForCausalLM.from_pretrained(path, device_map="cuda")

The mode comes from the ``mode`` argument or else from the environment variable
``MEMKIT_ALLOCATOR_WARMUP`` (``on|off|auto|cap``; also ``1/0/true/false/enable/disable``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_memkit.common.validation import check_int
from lightning_memkit.measure.device import effective_device_memory, memory_fraction, resolve_device

__all__ = [
    "DEFAULT_TARGET",
    "ENV_VAR",
    "WarmupDecision",
    "WarmupGuard",
    "guard_allocator_warmup",
    "parse_warmup_mode",
    "warmup_cap_bytes",
    "warmup_decision",
]

log = logging.getLogger("lightning_memkit")

ENV_VAR = "MEMKIT_ALLOCATOR_WARMUP"
DEFAULT_TARGET = "transformers.modeling_utils.caching_allocator_warmup"
DEFAULT_THRESHOLD = 24 * 2**30
DEFAULT_MARGIN = 2 * 2**30
_BYTE_COUNT_FN = "get_total_byte_count"  # sizes the warmup block in transformers.modeling_utils
_MARK = "__memkit_warmup_guard__"
_MODES = {
    "on": "on", "1": "on", "true": "on", "enable": "on",
    "off": "off", "0": "off", "false": "off", "disable": "off",
    "auto": "auto",
    "cap": "cap",
}
_ALLOWED = "on, off, auto, cap (or 1, 0, true, false, enable, disable; case-insensitive)"


def _gib(n: int | float) -> str:
    return f"{n / 2**30:.2f} GiB"


def parse_warmup_mode(mode: str | bool | None = None) -> tuple[str, str]:
    """``(mode, source)``: the normalised mode (``on|off|auto|cap``) and where it came from.

    ``None`` reads ``MEMKIT_ALLOCATOR_WARMUP`` (unset or empty means ``auto``). Anything not allowed is a
    ``ValueError`` listing the allowed values.
    """
    if isinstance(mode, bool):
        return ("on" if mode else "off"), "mode argument"
    if mode is None:
        raw = os.environ.get(ENV_VAR, "")
        if raw.strip() == "":
            return "auto", "default"
        value = _MODES.get(raw.strip().lower())
        if value is None:
            raise ValueError(f"{ENV_VAR}={raw!r} is not a warmup mode; allowed: {_ALLOWED}")
        return value, ENV_VAR
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a str, bool or None, got {type(mode).__name__}")
    value = _MODES.get(mode.strip().lower())
    if value is None:
        raise ValueError(f"mode={mode!r} is not a warmup mode; allowed: {_ALLOWED}")
    return value, "mode argument"


@dataclass(frozen=True)
class WarmupDecision:
    """What the guard does with the warmup on one device.

    Attributes:
        skip: ``True`` when the warmup is not run at all.
        reason: one sentence saying why, with the numbers used.
        mode: ``on``, ``off``, ``auto`` or ``cap``.
        device: the device the decision is for (the active accelerator unless one was given).
        effective_bytes: total memory x per-process fraction of that device, ``None`` if unknown.
        threshold_bytes: the ``auto`` threshold.
        cap_bytes: in ``cap`` mode, the largest block the warmup may reserve on ``device``
            (``None`` when free memory cannot be read; the warmup then keeps its own limit).
    """

    skip: bool
    reason: str
    mode: str
    device: str
    effective_bytes: int | None = None
    threshold_bytes: int = DEFAULT_THRESHOLD
    cap_bytes: int | None = None


_ALLOC_UNIT = 2 * 2**20


def warmup_cap_bytes(device: torch.device | str | int | None = None, margin_bytes: int = DEFAULT_MARGIN) -> int | None:
    """Largest new block this process can still reserve on ``device``, minus ``margin_bytes`` (>= 0).

    cuda/xpu: ``min(free memory of the card, total x fraction - bytes this process already reserved)``;
    other devices: their effective memory. ``None`` when the numbers cannot be read.
    """
    margin_bytes = check_int(margin_bytes, "margin_bytes", minimum=0, owner="warmup_cap_bytes")
    dev = resolve_device(device)
    if dev.type in ("cuda", "xpu"):
        mod = getattr(torch, dev.type)
        effective = effective_device_memory(dev)
        if effective is None:
            return None
        try:
            free, _total = mod.mem_get_info(dev.index)
            reserved = int(mod.memory_reserved(dev.index))
        except (RuntimeError, NotImplementedError, AttributeError, AssertionError):
            return None
        allocatable = min(int(free), effective - reserved)
    else:
        allocatable = effective_device_memory(dev)
        if allocatable is None:
            return None
    cap = max(0, allocatable - margin_bytes)
    if dev.type in ("cuda", "xpu"):  # the caching allocator hands out large blocks in 2 MiB units: stay below the cap
        cap = cap // _ALLOC_UNIT * _ALLOC_UNIT
    return cap


def warmup_decision(
    device: torch.device | str | int | None = None,
    threshold_bytes: int = DEFAULT_THRESHOLD,
    mode: str | bool | None = None,
    margin_bytes: int = DEFAULT_MARGIN,
) -> WarmupDecision:
    """Decide whether the allocator warmup runs on ``device`` (default: the active accelerator).

    ``auto`` skips the warmup when the effective memory (total x per-process fraction) is below
    ``threshold_bytes`` and keeps it when the memory cannot be read. ``cap`` keeps it with its block capped
    to :func:`warmup_cap_bytes`. Example::

        >>> warmup_decision("cpu", threshold_bytes=2**70, mode="auto").skip
        True
    """
    threshold_bytes = check_int(threshold_bytes, "threshold_bytes", minimum=0, owner="warmup_decision")
    margin_bytes = check_int(margin_bytes, "margin_bytes", minimum=0, owner="warmup_decision")
    value, source = parse_warmup_mode(mode)
    return _decide(resolve_device(device), threshold_bytes, margin_bytes, value, source)


def _decide(dev: torch.device, threshold_bytes: int, margin_bytes: int, value: str, source: str) -> WarmupDecision:
    name = str(dev)
    effective = effective_device_memory(dev)
    common = {"mode": value, "device": name, "effective_bytes": effective, "threshold_bytes": threshold_bytes}
    via = f"mode {value} ({source})"
    if value == "on":
        return WarmupDecision(skip=False, reason=f"{via}: warmup kept on {name}", **common)
    if value == "off":
        return WarmupDecision(skip=True, reason=f"{via}: warmup skipped on {name}", **common)
    if value == "cap":
        cap = warmup_cap_bytes(dev, margin_bytes)
        if cap is None:
            why = f"{via}: free memory of {name} unknown, warmup kept with its own limit"
        else:
            why = f"{via}: warmup block on {name} capped to {_gib(cap)} (free memory minus {_gib(margin_bytes)})"
        return WarmupDecision(skip=False, reason=why, cap_bytes=cap, **common)
    if effective is None:
        return WarmupDecision(skip=False, reason=f"{via}: memory of {name} unknown, warmup kept", **common)
    detail = f"{name} may use {_gib(effective)} (fraction {memory_fraction(dev):g})"
    if effective < threshold_bytes:
        why = f"{via}: {detail} < threshold {_gib(threshold_bytes)}, warmup skipped"
        return WarmupDecision(skip=True, reason=why, **common)
    return WarmupDecision(skip=False, reason=f"{via}: {detail} >= threshold {_gib(threshold_bytes)}, warmup kept",
                          **common)


# -- the scoped patch -------------------------------------------------------------------------------------
#
# Thread safety: every patch is reference-counted under one lock. The warmup function of a target is wrapped
# by the first active guard (in any thread) and put back by the last one to leave; the byte counter of a
# module is patched by the first capped warmup call in flight (in any thread) and put back by the last one to
# return. What a call does is decided by the calling thread's own innermost active guard (and, in ``cap``
# mode, its margin), kept per thread id, so guards in other threads never steer it.


@dataclass
class _Installed:
    """One wrapped target, shared by the active guards of every thread."""

    module: Any
    attr: str
    original: Callable
    wrapper: Callable
    stacks: dict[int, list[WarmupGuard]] = field(default_factory=dict)  # thread id -> its guards, innermost last

    def innermost(self, thread_id: int) -> WarmupGuard | None:
        stack = self.stacks.get(thread_id)
        return stack[-1] if stack else None


@dataclass
class _CappedCounter:
    """A module's byte counter, patched while any thread is inside a capped warmup call."""

    module: Any  # held so that its id, the key in _CAPPED, cannot be reused while patched
    original: Callable
    wrapper: Callable
    margins: dict[int, list[int]] = field(default_factory=dict)  # thread id -> margins of its calls in flight


_LOCK = threading.RLock()
_INSTALLED: dict[str, _Installed] = {}
_CAPPED: dict[int, _CappedCounter] = {}  # id(module) -> its patched byte counter


def _current_margin(key: int) -> int | None:
    with _LOCK:
        patch = _CAPPED.get(key)
        stack = patch.margins.get(threading.get_ident()) if patch is not None else None
        return stack[-1] if stack else None


def _make_capped(key: int, original: Callable) -> Callable:
    @functools.wraps(original)
    def capped(*args: Any, **kwargs: Any):
        counts = original(*args, **kwargs)
        margin_bytes = _current_margin(key)
        if margin_bytes is None:  # this thread is not inside a capped warmup call
            return counts
        for dev in list(counts):
            cap = warmup_cap_bytes(dev, margin_bytes)
            if cap is not None and counts[dev] > cap:
                log.info("allocator warmup on %s capped from %s to %s", dev, _gib(counts[dev]), _gib(cap))
                counts[dev] = cap
        return counts

    return capped


@contextlib.contextmanager
def _capped_byte_count(module: Any, margin_bytes: int) -> Iterator[None]:
    """Cap, per device and for this thread's call, the byte count the warmup sizes its block from.

    The counter is patched by the first capped call in flight (any thread) and restored by the last one.
    """
    key, tid = id(module), threading.get_ident()
    with _LOCK:
        patch = _CAPPED.get(key)
        if patch is None:
            original = getattr(module, _BYTE_COUNT_FN)
            patch = _CappedCounter(module, original, _make_capped(key, original))
            setattr(module, _BYTE_COUNT_FN, patch.wrapper)
            _CAPPED[key] = patch
        patch.margins.setdefault(tid, []).append(margin_bytes)
    try:
        yield
    finally:
        with _LOCK:
            stack = patch.margins[tid]
            stack.pop()
            if not stack:
                del patch.margins[tid]
            if not patch.margins:
                del _CAPPED[key]
                if getattr(module, _BYTE_COUNT_FN, None) is patch.wrapper:
                    setattr(module, _BYTE_COUNT_FN, patch.original)
                else:
                    log.warning("allocator warmup guard: %s.%s was replaced by other code meanwhile; left as it is",
                                getattr(module, "__name__", module), _BYTE_COUNT_FN)


def _make_wrapper(target: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any):
        with _LOCK:
            inst = _INSTALLED.get(target)
            guard = inst.innermost(threading.get_ident()) if inst is not None else None
        if guard is None:  # no guard active in this thread, or a stale reference kept by someone after release
            return original(*args, **kwargs)
        decision = guard._decide()
        guard.calls.append(decision)
        log.info("allocator warmup (%s): %s", target, decision.reason)
        if decision.skip:
            return None
        if decision.mode == "cap":
            with _capped_byte_count(inst.module, guard.margin_bytes):
                return original(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper


def _split_target(target: Any) -> tuple[str, str]:
    if not isinstance(target, str):
        raise TypeError(f"target must be a str 'package.module.function', got {type(target).__name__}")
    module_name, _, attr = target.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"target={target!r} must name a module attribute as 'package.module.function'")
    return module_name, attr


class WarmupGuard:
    """Context manager made by :func:`guard_allocator_warmup`; also :meth:`activate` / :meth:`release`.

    Nested ``with`` blocks (of this or another guard on the same target) share one wrapper: the target is
    wrapped once, reference-counted, and the innermost active guard decides. The original function is
    put back when the last guard leaves, exceptions included.

    Thread-safe: guards active in several threads at once share that one wrapper, and a call is decided by
    the calling thread's own innermost active guard; a thread with no active guard of its own gets the
    original behaviour. :meth:`release` may be called from another thread than the one that entered.

    Attributes:
        decision: the decision taken when the guard became active (``None`` before).
        calls: one :class:`WarmupDecision` per call of the wrapped function.
        installed: whether the target was found and wrapped (``False``: a no-op).
    """

    def __init__(self, target: str, mode: str | bool | None, threshold_bytes: int,
                 device: torch.device | str | int | None, margin_bytes: int):
        self.module_name, self.attr = _split_target(target)
        self.target = target
        self.mode, self.mode_source = parse_warmup_mode(mode)
        self.threshold_bytes = check_int(threshold_bytes, "threshold_bytes", minimum=0, owner="guard_allocator_warmup")
        self.margin_bytes = check_int(margin_bytes, "margin_bytes", minimum=0, owner="guard_allocator_warmup")
        if device is not None:
            resolve_device(device)  # validate now
        self.device = device
        self.decision: WarmupDecision | None = None
        self.calls: list[WarmupDecision] = []
        self.installed = False
        self._entries: list[int] = []  # the thread id of each active entry, oldest first

    @property
    def active(self) -> bool:
        return bool(self._entries)

    def _decide(self) -> WarmupDecision:
        return _decide(resolve_device(self.device), self.threshold_bytes, self.margin_bytes, self.mode,
                       self.mode_source)

    # -- entering and leaving -----------------------------------------------------------------------------
    def __enter__(self) -> WarmupGuard:
        tid = threading.get_ident()
        with _LOCK:
            if not self._entries:
                self.decision = self._decide()
                self.installed = self._install()  # raises with nothing changed
            if self.installed:
                _INSTALLED[self.target].stacks.setdefault(tid, []).append(self)
                log.debug("allocator warmup guard on %s: %s", self.target, self.decision.reason)
            self._entries.append(tid)
        return self

    def __exit__(self, *exc: Any) -> None:
        tid = threading.get_ident()
        with _LOCK:
            if not self._entries:
                return
            # this thread's latest entry; another thread's when this one has none (a release from elsewhere)
            mine = [i for i, t in enumerate(self._entries) if t == tid]
            owner = self._entries.pop(mine[-1] if mine else -1)
            if self.installed:
                self._uninstall(owner)
            if not self._entries:
                self.installed = False

    def activate(self) -> WarmupGuard:
        """Enter unless already active (idempotent, unlike nested ``with``)."""
        with _LOCK:
            if not self.active:
                self.__enter__()
        return self

    def release(self) -> None:
        """Leave completely, however often and in whichever threads it was entered; a no-op when not active."""
        with _LOCK:
            while self._entries:
                self.__exit__(None, None, None)

    def _install(self) -> bool:
        """Wrap the target unless another active guard already did; ``False`` when there is nothing to wrap."""
        inst = _INSTALLED.get(self.target)
        if inst is None:
            try:
                module = importlib.import_module(self.module_name)
            except ModuleNotFoundError as err:
                log.debug("allocator warmup guard: %s not importable (%s); nothing to guard", self.module_name, err)
                return False
            current = getattr(module, self.attr, None)
            if not callable(current):
                if self.target == DEFAULT_TARGET:
                    log.warning("allocator warmup guard: %s has no function %r in this version; nothing to guard",
                                self.module_name, self.attr)
                    return False
                raise ValueError(f"target={self.target!r}: module {self.module_name} has no callable {self.attr!r}")
            if getattr(current, _MARK, False):  # wrapped by another copy of this code: never wrap twice
                current = current.__wrapped__
            inst = _Installed(module, self.attr, current, _make_wrapper(self.target, current))
        if self.mode == "cap" and not callable(getattr(inst.module, _BYTE_COUNT_FN, None)):
            raise ValueError(
                f"mode='cap' needs {self.module_name}.{_BYTE_COUNT_FN} (which sizes the warmup block) and this "
                f"version has none; use mode 'auto', 'on' or 'off' for target={self.target!r}"
            )
        if self.target not in _INSTALLED:
            setattr(inst.module, self.attr, inst.wrapper)
            _INSTALLED[self.target] = inst
        return True

    def _uninstall(self, thread_id: int) -> None:
        """Drop one entry of this guard made in ``thread_id``; the last entry of all puts the original back."""
        inst = _INSTALLED.get(self.target)
        if inst is None:
            return
        stack = inst.stacks.get(thread_id, [])
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is self:
                del stack[i]
                break
        if not stack:
            inst.stacks.pop(thread_id, None)
        if inst.stacks:
            return
        del _INSTALLED[self.target]
        if getattr(inst.module, inst.attr, None) is inst.wrapper:
            setattr(inst.module, inst.attr, inst.original)
        else:
            log.warning("allocator warmup guard: %s was replaced by other code meanwhile; left as it is", self.target)

    def __repr__(self) -> str:
        return f"WarmupGuard(target={self.target!r}, mode={self.mode!r}, active={self.active})"


def guard_allocator_warmup(
    target: str = DEFAULT_TARGET,
    mode: str | bool | None = None,
    threshold_bytes: int = DEFAULT_THRESHOLD,
    device: torch.device | str | int | None = None,
    margin_bytes: int = DEFAULT_MARGIN,
) -> WarmupGuard:
    """Context manager: wrap ``target`` (a module-level function) so the warmup runs, is skipped or is capped.

    Arguments are validated here. Each call of the wrapped function decides again for ``device`` (the
    active accelerator at call time when ``None``) and records the decision in ``guard.calls``. A no-op
    with a debug log when the target's package is not installed. Example::

        from transformers import AutoModelForCausalLM
        with guard_allocator_warmup(mode="cap", margin_bytes=2 * 2**30) as guard:
            model = AutoModelForCausalLM.from_pretrained(path, device_map="cuda")
        print(guard.calls)
    """
    return WarmupGuard(target, mode, threshold_bytes, device, margin_bytes)
