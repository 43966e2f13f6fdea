"""The optimizer state and step on the host: the device keeps the parameters (and, until the step, the gradients);
the state and a copy of each parameter live in host memory, where the optimizer steps.

:class:`HostOffloadOptimizer` builds an optimizer of the configured one's class over host copies of its parameters
(the same groups and hyperparameters, read from the configured groups, which LR schedulers edit, before each step).
``step()`` runs the closure, copies each gradient device -> host (and frees it on the device), steps on the host and
copies each parameter host -> device. The copies keep the parameter's dtype, so the update is the configured
optimizer's, bitwise on CPU. On CUDA the transfer buffers are pinned and the copies ``non_blocking`` on a side stream:
the host step waits for the gradients, and the current stream waits for the parameters (the next forward runs after
them, without blocking the host). ``offload_gradients=True`` copies each gradient as soon as it is complete
(post-accumulate-grad hooks) and frees it: no full gradient buffer on the device either, but no gradient
accumulation, clipping or all-reduce after backward. ``state_dict()``/``load_state_dict()`` use the configured
optimizer's format (the state's tensors on the host), so a checkpoint moves between runs with and without it.

A parameter written between steps (weights loaded, ``copy_`` under ``no_grad``: its version counter or its storage
changed) is copied to the host again before the next step. Writes through ``.data``, which torch does not version,
are not seen: the step would overwrite them.

Every host tensor (copies, buffers, state) is made inside :func:`~lightning_memkit.measure.live_peak.host_memory`:
:class:`~lightning_memkit.measure.live_peak.LivePeak` counts it as host bytes, apart from the device's.

Why not torchao's ``CPUOffloadOptimizer`` (0.18): it refuses to run without CUDA or XPU (an ``assert`` in its
constructor), so neither the tests nor a CPU estimate can run it; its ``state_dict()`` is a list of per-parameter
optimizers' (a checkpoint does not resume without it), its ``param_groups`` are per-parameter copies (an LR scheduler
built on the configured optimizer would not reach them), it keeps parameters under 4096 elements on the device, and
it steps the CPU AdamW ``fused`` (other rounding than the configured optimizer). This module does the same transfers
in plain torch.

Example (on CPU the "device" is the CPU too: the copies are host memory all the same)::

    >>> import torch
    >>> from lightning_memkit.measure.live_peak import LivePeak
    >>> model = torch.nn.Linear(256, 256, bias=False)            # 256 KiB of float32 weight
    >>> with LivePeak() as lp:
    ...     opt = HostOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    ...     model(torch.randn(4, 256)).sum().backward()
    ...     _ = opt.step()
    >>> lp.live_bytes, lp.host_live_bytes // 1024                # copy, gradient buffer, exp_avg, exp_avg_sq (KiB)
    (0, 1024)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memkit.measure.live_peak import host_memory, note_host
from lightning_memkit.measure.storage import iter_tensors, storage_key
from lightning_memkit.optim.wrapper import (
    StandInOptimizer,
    check_separable,
    copy_hyperparameters,
    lever_factory,
    same_class,
)

__all__ = ["HostOffloadOptimizer", "host_offload"]

_OWNER = "HostOffloadOptimizer"


@dataclass
class _Slot:
    """One parameter: its host copy (whose ``.grad`` is the host gradient buffer while a step runs), the buffer, and
    what the device parameter was when the copy was last made (its version and storage: a change means someone
    wrote the parameter, and the copy is made again before the step)."""

    host: torch.Tensor
    grad: torch.Tensor
    seen: tuple[int, int]
    ready: bool = False  # the gradient is in the buffer (copied by the hook), for the next step


class HostOffloadOptimizer(StandInOptimizer):
    """Keeps ``optimizer``'s state and step on the host, with a host copy of each parameter.

    Args:
        optimizer: the configured optimizer (torch's SGD, Adam, AdamW, ...: one of
            :data:`~lightning_memkit.optim.wrapper.SEPARABLE`); its state, if any, moves to the host.
        offload_gradients: copy each gradient to the host as soon as it is complete, and free it on the device (no
            full gradient buffer on the device; no accumulation, clipping or all-reduce after backward).

    Attributes:
        host_optimizer: the optimizer over the host copies (its ``state`` is the state). This optimizer's own
            ``state`` is empty: nothing on the device to move.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, offload_gradients: bool = False) -> None:
        check_separable(optimizer, _OWNER)
        if not isinstance(offload_gradients, bool):
            raise TypeError(f"{_OWNER}(offload_gradients={offload_gradients!r}) must be a bool")
        super().__init__(optimizer)
        self.offload_gradients = offload_gradients
        device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._slots: dict[torch.Tensor, _Slot] = {}
        with torch.no_grad(), host_memory():
            groups = [{**g, "params": [self._make_slot(p).host for p in g["params"]]} for g in optimizer.param_groups]
            self.host_optimizer = same_class(optimizer, groups)
            state = optimizer.state_dict()
            if state["state"]:
                self.host_optimizer.load_state_dict(state)
        self._note_host()
        optimizer.state.clear()
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_ready)
                         for p in self._slots if p.requires_grad] if offload_gradients else []

    def _make_slot(self, p: torch.Tensor) -> _Slot:
        pin = p.device.type == "cuda"
        host = torch.empty_like(p, device="cpu", pin_memory=pin)
        host.copy_(p.detach())
        slot = self._slots[p] = _Slot(host, torch.empty_like(host, pin_memory=pin), _seen(p))
        return slot

    # -- transfers -----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _side_stream(self) -> Iterator[None]:
        """On CUDA: the block's copies run on the side stream, after the work queued so far on the current one."""
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            yield

    def _grad_to_host(self, p: torch.Tensor, slot: _Slot) -> None:
        """Queue the copy of ``p``'s gradient into its host buffer, and free the device gradient."""
        slot.grad.copy_(p.grad, non_blocking=self._stream is not None)
        if self._stream is not None:
            p.grad.record_stream(self._stream)  # its memory is not reused before the copy ran
        p.grad = None
        slot.ready = True

    def _grad_ready(self, p: torch.Tensor) -> None:
        slot = self._slots[p]
        if slot.ready:
            raise RuntimeError(f"{_OWNER}(offload_gradients=True): a second gradient of the {tuple(p.shape)} "
                               "parameter before step()/zero_grad(); gradients cannot accumulate on the host")
        with self._side_stream():
            self._grad_to_host(p, slot)

    # -- stepping ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (forward and backward), then: gradients to the host, the step there, parameters back.
        Returns the closure's result."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with self._side_stream():
            for p, slot in self._slots.items():
                if p.grad is not None:
                    self._grad_to_host(p, slot)
        if self._stream is not None:
            self._stream.synchronize()  # the gradients are on the host
        self._step_on_host()
        with self._side_stream():
            for p, slot in self._slots.items():
                p.copy_(slot.host, non_blocking=self._stream is not None)
                slot.seen = _seen(p)
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)  # the next forward waits
        self.mark_stepped()
        return loss

    def _step_on_host(self) -> None:
        for p, slot in self._slots.items():
            if _seen(p) != slot.seen:  # written since the last step (weights loaded): copy it again
                slot.host.copy_(p)
            slot.host.grad = slot.grad if slot.ready else None  # no gradient this step: not stepped
        for source, target in zip(self.param_groups, self.host_optimizer.param_groups):
            copy_hyperparameters(source, target)
        with host_memory():
            self.host_optimizer.step()
        for slot in self._slots.values():
            slot.host.grad = None
            slot.ready = False
        self._note_host()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Free the device gradients and forget those already copied to the host."""
        for p, slot in self._slots.items():
            p.grad = None
            slot.ready = False

    # -- state ---------------------------------------------------------------------------------------------------
    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:  # type: ignore[override]
        """Empty: the state is on the host (:attr:`host_optimizer`), so moving "the optimizer's state" to the device
        (as Lightning does after loading a checkpoint) moves nothing."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The configured optimizer's format (the state's tensors on the host): it loads into a run without it."""
        for source, target in zip(self.param_groups, self.host_optimizer.param_groups):
            copy_hyperparameters(source, target)
        return self.host_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` of the configured optimizer's class (saved with or without the lever): the state
        goes to the host, the hyperparameters to the configured groups."""
        with host_memory():
            self.host_optimizer.load_state_dict(state_dict)
        self._note_host()
        for source, target in zip(self.host_optimizer.param_groups, self.param_groups):
            copy_hyperparameters(source, target)

    def _note_host(self) -> None:
        """Every host tensor is host memory for the trackers open now: also the state that loading kept as it came,
        and for trackers that file storages by their device alone."""
        for slot in self._slots.values():
            note_host(slot.host)
            note_host(slot.grad)
        for t in iter_tensors(list(self.host_optimizer.state.values())):
            note_host(t)

    def restore(self) -> torch.optim.Optimizer:
        """Remove the hooks (``offload_gradients``) and give the configured optimizer back, holding the state (its
        tensors stay on the host: load it with ``load_state_dict`` to have them on the device)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for p, host in zip(self._slots, (h for g in self.host_optimizer.param_groups for h in g["params"])):
            if host in self.host_optimizer.state:
                self.configured.state[p] = self.host_optimizer.state[host]
        self.host_optimizer.state.clear()
        return self.configured

    def __enter__(self) -> HostOffloadOptimizer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def _seen(p: torch.Tensor) -> tuple[int, int]:
    return p._version, storage_key(p)


def host_offload(factory: Callable[[torch.nn.Module], torch.optim.Optimizer], *, offload_gradients: bool = False
                 ) -> Callable[[torch.nn.Module], HostOffloadOptimizer]:
    """``factory`` (``model -> optimizer``, as ``estimate_training_memory(optimizer=...)`` takes) with its state and
    step on the host: ``model -> HostOffloadOptimizer(factory(model), offload_gradients=...)``.

    Example::

        >>> def adamw(model):
        ...     return torch.optim.AdamW(model.parameters())
        >>> host_offload(adamw).__name__
        'host_offload(adamw)'
    """
    return lever_factory(factory, HostOffloadOptimizer, "host_offload", offload_gradients=offload_gradients)
