"""Split each training batch inside the step into micro-batches, and recover a step that runs out of memory.

Example::

    from lightning import Trainer
    from lightning_memkit.callbacks import MicroBatchSplit

    # batches of 32 rows trained as 4 micro-batches of 8: the same samples and the same mean loss per step
    trainer = Trainer(callbacks=[MicroBatchSplit(max_rows=8)])

YAML (LightningCLI)::

    trainer:
      callbacks:
        - class_path: lightning_memkit.callbacks.MicroBatchSplit
          init_args: {max_rows: 8, max_retries: 2}
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.memory import is_oom_error
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lightning_memkit.common.batches import WEIGHTS, batch_rows, batch_shape, split_batch
from lightning_memkit.common.step_output import training_loss
from lightning_memkit.common.validation import check_choice, check_int

__all__ = ["MicroBatchSplit", "OutOfMemoryStep", "StepRetriesExhausted"]

_OWNER = "MicroBatchSplit"
_log = logging.getLogger(__name__)
_HOOKS = ("training_step", "backward", "optimizer_step", "optimizer_zero_grad", "configure_gradient_clipping")


class StepRetriesExhausted(RuntimeError):
    """An out-of-memory step that was not recovered: the retries are spent or nothing stronger is left."""


@dataclass
class OutOfMemoryStep:
    """What ran out of memory: where (``"forward"``, ``"backward"``, ``"optimizer step"``, ``"retry"``), the
    global step, the batch, its shape in words and the error's first line."""

    where: str
    step: int
    batch: Any
    shape: str
    error: str


class MicroBatchSplit(Callback):
    """Train each batch as micro-batches of at most ``max_rows`` rows, inside the training step; optionally retry a
    step that runs out of memory with a stronger setting.

    The split happens in the module's ``training_step`` (patched from ``on_fit_start`` to ``teardown``): each
    micro-batch runs forward and backward in turn, its loss weighted so that the weighted sum is the loss of the
    whole batch (``weight``: by rows, by label tokens for a transformers causal-LM batch, see
    :func:`~lightning_memkit.common.batches.split_batch`), and the last one's loss is returned to Lightning, which
    runs its backward and the optimizer step as usual. The loader, its batch size, the validation batches and
    ``accumulate_grad_batches`` are unchanged, so every optimizer step sees the same samples as without the split,
    whatever the size of the data set; the loss Lightning logs is the whole batch's. A batch of at most
    ``max_rows`` rows runs as it is.

    With ``max_retries > 0``, an error that Lightning's ``is_oom_error`` recognises (CUDA's, or the CPU allocator's
    "DefaultCPUAllocator: can't allocate memory") raised in a step's forward, backward or optimizer step is caught:
    the garbage collected and the device cache emptied, ``on_out_of_memory`` asked for a stronger setting (by
    default the micro-batches halved), the gradients zeroed and the accumulation window in which it struck run
    again from its first micro-batch (its batches are kept until its optimizer step), so that no sample is
    skipped or counted twice. An error in the optimizer step after it changed a parameter or its state is not
    retried (a retry would apply part of the update twice). After ``max_retries`` recoveries in a fit, the next
    such error stops the run with :class:`StepRetriesExhausted`, one line naming the batch shape.

    Under DDP (several processes) every rank agrees before any retries: the whole step's forward and backward run
    inside the training step without synchronising gradients, every rank then says (one ``all_gather`` of a flag)
    whether its part ran out of memory; the ranks that did run it again, stronger, while the others wait; then
    the loss Lightning backpropagates only synchronises the gradients (a zero term reaching every trainable
    parameter, so DDP reduces them as after accumulation). After the optimizer step the ranks agree again; a rank
    whose step ran out of memory before changing anything runs the optimizer's step again on the reduced
    gradients. A rank that cannot recover stops every rank, each with one line. Under other strategies with
    several processes (FSDP, DeepSpeed, pipelines), whose collectives run inside the step, out-of-memory errors
    are not recovered (one line says so): one rank's error would leave the others waiting in a collective.

    Needs automatic optimization.

    Args:
        max_rows: the most rows a micro-batch has (``None``: batches are not split).
        weight: how micro-batch losses are weighted: ``"auto"``, ``"rows"``, ``"tokens"``, ``"sum"``.
        max_retries: out-of-memory steps recovered per fit (0: none).

    Attributes:
        recoveries: one line per recovered step (``"step 3, forward, batch input_ids 8x64: micro-batches of 4"``).
        on_out_of_memory: called with an :class:`OutOfMemoryStep`; applies a stronger setting and returns a line
            saying what, or ``None`` when there is none (the error then stops the run).
    """

    def __init__(self, max_rows: int | None = None, weight: str = "auto", max_retries: int = 0) -> None:
        self.max_rows = check_int(max_rows, "max_rows", minimum=1, allow_none=True, owner=_OWNER)
        self.weight = check_choice(weight, "weight", WEIGHTS, owner=_OWNER)
        self.max_retries = check_int(max_retries, "max_retries", minimum=0, owner=_OWNER)
        self.on_out_of_memory: Callable[[OutOfMemoryStep], str | None] = self._halve
        self.recoveries: list[str] = []
        self._module: LightningModule | None = None
        self._trainer: Trainer | None = None
        self._originals: dict[str, Any] = {}
        self._wrappers: dict[str, Any] = {}
        self._window: list[tuple[Any, int]] = []
        self._current: tuple[Any, int] | None = None
        self._skip_zero = False
        self._inner = 0  # > 0: inside our own re-runs, the hooks pass through
        self._recovering = False  # out-of-memory steps are recovered in this fit
        self._clipped = False  # the optimizer step's gradients were clipped (Lightning's clipping hook returned)
        self._passes_batch_idx = True

    # -- hooks -------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise ValueError(f"{_OWNER} splits the batch inside Lightning's automatic optimization; "
                             f"{type(pl_module).__name__} sets automatic_optimization=False")
        self._restore()
        self._trainer, self.recoveries = trainer, []
        self._window, self._current, self._skip_zero = [], None, False
        self._recovering = bool(self.max_retries) and _recoverable_on(trainer)
        if self.max_retries and not self._recovering and trainer.is_global_zero:
            rank_zero_info(f"{_OWNER}: out-of-memory steps are not recovered under {type(trainer.strategy).__name__} "
                           f"with {trainer.world_size} processes (its collectives run inside the step: one rank's "
                           "error would leave the others waiting); such an error stops the run")
        self._patch(pl_module)

    def _patch(self, pl_module: LightningModule) -> None:
        self._module = pl_module
        self._passes_batch_idx = is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2)
        for name in _HOOKS:
            self._originals[name] = getattr(pl_module, name)
            self._wrappers[name] = _wrapper(self._originals[name], getattr(self, f"_{name}"))
            setattr(pl_module, name, self._wrappers[name])

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The module's own hooks back for the block (to copy or estimate it), ours again after it."""
        module = self._module
        self._restore()
        try:
            yield
        finally:
            if module is not None:
                self._patch(module)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Keep the batches of the accumulation window until its optimizer step (to run it again)."""
        if batch_idx % _accumulate(trainer) == 0:
            self._window = []
        elif self._current is not None and self.max_retries:
            self._window.append(self._current)
        self._current = (batch, batch_idx)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore()
        self._window, self._current = [], None

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore()
        self._window, self._current = [], None

    def _restore(self) -> None:
        """Put the module's own hooks back (ours stay as pass-throughs where something patched over them)."""
        module, self._module = self._module, None
        for name, wrapper in self._wrappers.items():
            if module is not None and vars(module).get(name) is wrapper:
                original = self._originals[name]
                if getattr(original, "__self__", None) is module and getattr(original, "__func__", None) is getattr(
                        type(module), name, None):
                    delattr(module, name)
                else:
                    setattr(module, name, original)
        self._wrappers = {}

    def _active(self) -> bool:
        return self._module is not None and not self._inner

    # -- the patched hooks -------------------------------------------------------------------------
    def _training_step(self, batch: Any, batch_idx: int = 0, *args: Any, **kwargs: Any) -> Any:
        if not self._active():
            return self._call_step(batch, batch_idx, *args, **kwargs)
        self._skip_zero = False
        if self._agreeing():
            return self._agreed_step(batch, batch_idx)

        def run() -> Any:
            return self._run(batch, batch_idx, backward_last=False)

        return self._settled(run, lambda: self._replay_window(run), "forward", batch)

    def _agreed_step(self, batch: Any, batch_idx: int) -> Any:
        """The step under several processes: every micro-batch's forward and backward here, unsynchronised, every
        rank agreeing on the outcome; Lightning then backpropagates a zero term that synchronises the gradients."""

        def run() -> Any:
            return self._run(batch, batch_idx, backward_last=True)

        out = self._settled(run, lambda: self._replay_window(run), "forward or backward", batch)
        self._skip_zero = batch_idx % _accumulate(self._trainer) == 0  # zeroed already, before the first backward
        return _with_loss(out, _loss_of(out) + _zero_reaching(self._module))

    def _backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if not self._active() or self._agreeing():  # several processes: this backward only synchronises
            return self._originals["backward"](loss, *args, **kwargs)
        batch, batch_idx = self._current

        def backward() -> None:
            self._originals["backward"](loss, *args, **kwargs)

        def run() -> Any:
            return self._run(batch, batch_idx, backward_last=True)

        self._settled(backward, lambda: self._replay_window(run), "backward", batch)
        return None

    def _optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        step = self._originals["optimizer_step"]
        if not (self._active() and self._recovering):  # nothing to recover: no version counters read each step
            return step(epoch, batch_idx, optimizer, optimizer_closure)
        seen: dict[str, Any] = {}
        self._clipped = False

        def closure() -> Any:
            seen["result"] = optimizer_closure()
            seen["versions"] = _versions(optimizer)
            return seen["result"]

        def attempt() -> Any:
            try:
                return step(epoch, batch_idx, optimizer, closure)
            except Exception as err:  # noqa: BLE001
                if "versions" in seen and is_oom_error(err) and not _untouched(optimizer, seen["versions"]):
                    raise StepRetriesExhausted(
                        f"{_OWNER}: step {self._trainer.global_step} ran out of memory in the optimizer step after the "
                        f"optimizer had changed a parameter or its state (batch {self._shape()}); not retried: a "
                        "retry would apply part of the update twice") from err
                if self._agreeing() and "versions" not in seen and is_oom_error(err):
                    raise StepRetriesExhausted(  # the synchronising backward: its collectives cannot be re-run alone
                        f"{_OWNER}: step {self._trainer.global_step} ran out of memory while synchronising "
                        f"gradients (batch {self._shape()}): {_first_line(err)}") from err
                raise

        if self._agreeing():  # the gradients are reduced already: this rank runs only the optimizer's step again
            return self._settled(attempt, lambda: self._step_again(step, epoch, batch_idx, optimizer, seen),
                                 "optimizer step", self._batch())
        return self._settled(attempt, lambda: self._replay_window(lambda: step(epoch, batch_idx, optimizer, closure)),
                             "optimizer step", self._batch())

    def _configure_gradient_clipping(self, *args: Any, **kwargs: Any) -> None:
        self._originals["configure_gradient_clipping"](*args, **kwargs)
        self._clipped = True  # the gradients are final: an optimizer step run again must not clip them again

    def _optimizer_zero_grad(self, *args: Any, **kwargs: Any) -> None:
        if self._skip_zero and self._active():  # zeroed already, after the first micro-batch's forward
            self._skip_zero = False
            return None
        return self._originals["optimizer_zero_grad"](*args, **kwargs)

    # -- the split step ----------------------------------------------------------------------------
    def _call_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        step = self._originals["training_step"]
        return step(batch, batch_idx, *args, **kwargs) if self._passes_batch_idx else step(batch, *args, **kwargs)

    def _run(self, batch: Any, batch_idx: int, backward_last: bool, zero: bool = True) -> Any:
        """The step of ``batch`` in micro-batches: each one's forward and (but the last's, unless
        ``backward_last``) backward; returns the last one's output with the whole batch's loss as value (with a
        graph unless ``backward_last``)."""
        chunks = split_batch(batch, self.max_rows, self.weight)
        if len(chunks) == 1 and not backward_last:
            return self._call_step(batch, batch_idx)
        trainer = self._trainer
        first = zero and batch_idx % _accumulate(trainer) == 0
        done: torch.Tensor | None = None
        for i, (chunk, weight) in enumerate(chunks):
            out = self._call_step(chunk, batch_idx)
            loss = _loss_of(out) * weight
            if i == len(chunks) - 1 and not backward_last:
                return _with_loss(out, loss + done)
            if i == 0 and first:
                self._zero_grad(batch_idx)
                self._skip_zero = not backward_last
            self._backward_inner(loss / _accumulate(trainer))
            done = loss.detach() if done is None else done + loss.detach()
            if i < len(chunks) - 1:
                del out
            del loss
        return _with_loss(out, done)

    def _zero_grad(self, batch_idx: int) -> None:
        self._originals["optimizer_zero_grad"](self._trainer.current_epoch, batch_idx, self._trainer.optimizers[0])

    def _backward_inner(self, loss: torch.Tensor) -> None:
        """A micro-batch's backward through the strategy (precision scaling, hooks), not synchronised across
        processes (the last micro-batch's backward is)."""
        trainer = self._trainer
        block = getattr(trainer.strategy, "block_backward_sync", None)
        self._inner += 1
        try:
            if callable(block) and trainer.world_size > 1:
                with block():
                    trainer.strategy.backward(loss, trainer.optimizers[0])
            else:
                trainer.strategy.backward(loss, trainer.optimizers[0])
        finally:
            self._inner -= 1

    # -- recovery ----------------------------------------------------------------------------------
    def _agreeing(self) -> bool:
        """Whether out-of-memory steps are recovered with every rank agreeing (several processes)."""
        return self._recovering and self._trainer.world_size > 1

    def _batch(self) -> Any:
        return self._current[0] if self._current else None

    def _shape(self) -> str:
        return batch_shape(self._batch()) if self._current else "unknown"

    def _settled(self, attempt: Callable[[], Any], retry: Callable[[], Any], where: str, batch: Any) -> Any:
        """``attempt()``; after an out-of-memory error, a stronger setting and ``retry()``, until it succeeds or
        the retries are spent. Under several processes every rank then agrees (a flag each): the ranks whose part
        failed retry while the others wait, and an error one rank cannot recover stops every rank."""
        result, event, fatal = self._try(attempt, where, batch)
        while True:
            code = 2 if fatal is not None else 1 if event is not None else 0
            codes = self._agree(code) if self._agreeing() else [code]
            if fatal is not None:
                raise fatal
            if 2 in codes:
                raise StepRetriesExhausted(self._stopped_by(codes, where))
            if max(codes) == 0:
                return result
            if event is None:  # another rank retries: wait for it at the next agreement
                continue
            try:
                self._strengthen(event)
            except StepRetriesExhausted as err:
                if not self._agreeing():
                    raise
                event, fatal = None, err
                continue
            result, event, fatal = self._try(retry, "retry", batch)

    def _try(self, fn: Callable[[], Any], where: str, batch: Any) -> tuple[Any, OutOfMemoryStep | None, Any]:
        """``fn()``'s result, or the out-of-memory event it raised (the error and its frames, which hold the failed
        step's tensors, are let go), or, under several processes, the error to raise once the ranks agreed."""
        try:
            return fn(), None, None
        except Exception as err:  # noqa: BLE001 - only out-of-memory errors are recovered
            event = self._event(err, where, batch)
            if event is None and not self._agreeing():
                raise
            return None, event, err if event is None else None

    def _event(self, err: BaseException, where: str, batch: Any) -> OutOfMemoryStep | None:
        """``err`` as an out-of-memory event to recover, or ``None`` (an error not recovered)."""
        if not (self._recovering and is_oom_error(err)) or isinstance(err, StepRetriesExhausted):
            return None
        step = int(self._trainer.global_step)
        return OutOfMemoryStep(where, step, batch, batch_shape(batch), _first_line(err))

    def _agree(self, code: int) -> list[int]:
        """Every rank's code (0: done, 1: retrying, 2: stopping), one ``all_gather``."""
        strategy = self._trainer.strategy
        return strategy.all_gather(torch.tensor([code], device=strategy.root_device)).flatten().tolist()

    def _stopped_by(self, codes: list[int], where: str) -> str:
        ranks = ", ".join(str(r) for r, c in enumerate(codes) if c == 2)
        return (f"{_OWNER}: rank {ranks} stopped step {self._trainer.global_step} ({where}, batch {self._shape()}) "
                "with an error it could not recover (its own line says which); every rank stops")

    def _strengthen(self, event: OutOfMemoryStep) -> None:
        gc.collect()
        from lightning_memkit.release.phases import empty_device_cache

        empty_device_cache()
        if len(self.recoveries) >= self.max_retries:
            raise StepRetriesExhausted(self._exhausted(event, f"after {self.max_retries} recovered steps"))
        line = self.on_out_of_memory(event)
        if line is None:
            raise StepRetriesExhausted(self._exhausted(event, "and nothing stronger is left"))
        self.recoveries.append(f"step {event.step}, {event.where}, batch {event.shape}: {line}")
        rank = f" on rank {self._trainer.global_rank}" if self._trainer.world_size > 1 else ""
        _log.warning(f"{_OWNER}: out of memory at step {event.step}{rank} ({event.where}, batch {event.shape}); "
                     f"retrying with {line}")

    def _exhausted(self, event: OutOfMemoryStep, why: str) -> str:
        return (f"{_OWNER}: step {event.step} ran out of memory in its {event.where} (batch {event.shape}) {why}: "
                f"{event.error}")

    def _replay_window(self, rerun: Callable[[], Any]) -> Any:
        """Zero the gradients, run the window's batches before the current one again (forward and backward),
        then ``rerun()`` the current one."""
        batch_idx = self._current[1] if self._current else 0
        self._zero_grad(batch_idx)
        self._skip_zero = False
        for batch, idx in self._window:
            self._run(batch, idx, backward_last=True, zero=False)
        return rerun()

    def _step_again(self, step: Callable[..., Any], epoch: int, batch_idx: int, optimizer: Any,
                    seen: dict[str, Any]) -> Any:
        """The optimizer step again on the gradients already reduced, without running the step's forward and
        backward: through Lightning (``on_before_optimizer_step``, clipping) when the error struck before clipping
        was done, else the optimizer's own step alone (clipping again would change the gradients again)."""
        if not self._clipped:
            return step(epoch, batch_idx, optimizer, lambda: seen["result"])
        if getattr(self._trainer.precision_plugin, "scaler", None) is not None:
            raise StepRetriesExhausted(f"{_OWNER}: step {self._trainer.global_step}'s optimizer step ran out of "
                                       "memory under a gradient scaler after the gradients were changed; not retried")
        return getattr(optimizer, "optimizer", optimizer).step()

    def _halve(self, event: OutOfMemoryStep) -> str | None:
        """The default stronger setting: micro-batches of half the rows (rounded up)."""
        rows = batch_rows(event.batch) if event.batch is not None else None
        current = min(self.max_rows or rows or 1, rows or 1)
        if current <= 1:
            return None
        self.max_rows = -(-current // 2)
        return f"micro-batches of {self.max_rows} rows"


def _accumulate(trainer: Trainer) -> int:
    """The micro-batches of an optimizer step, as Lightning counts them (its first zeroes the gradients)."""
    return max(int(trainer.accumulate_grad_batches), 1)


def _wrapper(original: Any, impl: Callable[..., Any]) -> Callable[..., Any]:
    """A function standing in for the module's hook ``original`` that runs ``impl``."""

    @functools.wraps(original)
    def hook(*args: Any, **kwargs: Any) -> Any:
        return impl(*args, **kwargs)

    return hook


def _recoverable_on(trainer: Trainer) -> bool:
    """Whether an out-of-memory step can be recovered under the Trainer's strategy: one process, or DDP (whose only
    collectives, the gradient reduction, run after the step's forward and backward here)."""
    from lightning.pytorch.strategies import DDPStrategy

    return trainer.world_size == 1 or type(trainer.strategy) is DDPStrategy


def _zero_reaching(module: torch.nn.Module) -> torch.Tensor:
    """Zero, with a graph to every trainable parameter of ``module``: its backward adds nothing to the gradients
    (a sum's gradient is a broadcast view, added in place) but runs DDP's reduction hooks for every one."""
    terms = [p.sum(dtype=torch.float32) * 0 for p in module.parameters() if p.requires_grad]
    return torch.stack(terms).sum() if terms else torch.zeros(())


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0][:200] if str(err) else type(err).__name__


def _loss_of(output: Any) -> torch.Tensor:
    loss = training_loss(output)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{_OWNER}: training_step must return a loss tensor or a dict with 'loss' to be split into "
                        f"micro-batches; it returned {type(output).__name__}")
    return loss


def _with_loss(output: Any, loss: torch.Tensor) -> Any:
    if isinstance(output, dict):
        return {**output, "loss": loss}
    return loss


def _versions(optimizer: Any) -> tuple[tuple[int, ...], dict[Any, dict[str, int | None]]]:
    """The in-place version counters of an optimizer's parameters, and of its state by parameter and key (``None``
    for a value that is not a tensor): any change to them bumps a counter."""
    inner = getattr(optimizer, "optimizer", optimizer)
    params = tuple(p._version for group in inner.param_groups for p in group["params"])
    state = {p: {k: v._version if isinstance(v, torch.Tensor) else None for k, v in s.items()}
             for p, s in inner.state.items()}
    return params, state


def _counted(optimizer: Any) -> bool:
    """Whether the version counters see every in-place change of the optimizer's step: its foreach and fused
    kernels do not bump them under a Python dispatch mode (such as ``LivePeak``'s on a measured CPU step)."""
    if _get_current_dispatch_mode() is None:
        return True
    inner = getattr(optimizer, "optimizer", optimizer)
    return all(not g.get("fused") and (g.get("foreach") is False or (
        g.get("foreach") is None and all(p.device.type == "cpu" for p in g["params"]))) for g in inner.param_groups)


def _untouched(optimizer: Any, seen: tuple[tuple[int, ...], dict[Any, dict[str, int | None]]]) -> bool:
    """Whether a failed optimizer step left the parameters and the state it started with as they were; the state
    it had begun to create (for parameters without state before, e.g. a first Adam step) is dropped, to be created
    again by the retry."""
    params, state = _versions(optimizer)
    if not _counted(optimizer) or params != seen[0] or any(state.get(p) != before for p, before in seen[1].items()):
        return False
    inner = getattr(optimizer, "optimizer", optimizer)
    for p in [p for p in inner.state if p not in seen[1]]:
        del inner.state[p]
    return True
