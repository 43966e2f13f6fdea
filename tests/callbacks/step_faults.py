"""Out-of-memory errors injected into a training step (the CPU allocator's message, which Lightning's
``is_oom_error`` recognises), and the loss of each optimizer step."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch._subclasses.fake_tensor import FakeTensor

OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1048576 bytes. Error code 12"
WHERE = ("forward", "backward", "optimizer")


class StepLosses(pl.Callback):
    """The loss of each optimizer step (the micro-batch losses Lightning reports are divided by the accumulation)."""

    def __init__(self) -> None:
        self.batches: list[float] = []
        self.accumulate = 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.accumulate = trainer.accumulate_grad_batches
        self.batches.append(float(outputs["loss"]))

    @property
    def steps(self) -> list[float]:
        k = self.accumulate
        return [sum(self.batches[i:i + k]) for i in range(0, len(self.batches), k)]


class InjectOOM(pl.Callback):
    """Raise the allocator's out-of-memory error in the ``where`` of optimizer step ``at_step`` (its ``micro``-th
    micro-batch for forward and backward), ``times`` times in all (each retry of that step raises again until then).
    Forward: a hook on the first ``nn.Linear``; backward: a full backward hook on it; optimizer:
    ``on_before_optimizer_step`` (in the optimizer's step, after the closure, before any update)."""

    def __init__(self, where: str, at_step: int = 2, times: int = 1, micro: int = 1) -> None:
        assert where in WHERE
        self.where, self.at_step, self.left, self.micro = where, at_step, times, micro
        self.raised = 0
        self._calls = 0
        self._handles: list = []

    def on_train_start(self, trainer, pl_module) -> None:
        layer = next(m for m in pl_module.modules() if isinstance(m, torch.nn.Linear))
        if self.where == "forward":
            self._handles.append(layer.register_forward_hook(lambda m, i, out: self._fire(trainer, out)))
        elif self.where == "backward":
            self._handles.append(layer.register_full_backward_hook(lambda m, gi, go: self._fire(trainer, go[0])))


    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.where == "optimizer":  # inside the optimizer's step, after the closure, before any update
            self._fire(trainer)

    def _fire(self, trainer, tensor=None) -> None:
        if trainer.global_step != self.at_step or self.left <= 0 or not trainer.training:
            return
        if isinstance(tensor, FakeTensor):  # the budget's estimates copy the module, hooks too: only real steps fail
            return
        self._calls += 1
        if self._calls >= self.micro:
            self.left -= 1
            self.raised += 1
            raise RuntimeError(OOM)

    def teardown(self, trainer, pl_module, stage) -> None:
        for handle in self._handles:
            handle.remove()


def short_estimates(monkeypatch, nbytes: int) -> None:
    """Every estimate misses ``nbytes`` (as if the step held a buffer the estimate cannot see): a plan that looks
    as if it fits does not (a prediction wrong on purpose)."""
    from lightning_memkit.estimate.module import ModuleRun

    real = ModuleRun.estimate

    def estimate(self, plan):
        est = real(self, plan)
        est.peak_bytes -= nbytes
        return est

    monkeypatch.setattr(ModuleRun, "estimate", estimate)
