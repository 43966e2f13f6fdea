"""Give back what a finished fit/validate/test/predict phase still holds, then prove it in bytes.

Example::

    from lightning import Trainer
    from lightning_memkit.callbacks import PhaseMemoryRelease

    release = PhaseMemoryRelease(after=("fit", "test"))
    trainer = Trainer(callbacks=[release])
    trainer.fit(model)     # optimizer state, optimizers, schedulers, grads and cached blocks released
    trainer.test(model)
    print(release.results[-1])   # PhaseReleaseResult(stage='test', retained_bytes=..., ...)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from lightning_memkit.common.validation import check_int
from lightning_memkit.measure.live_peak import LivePeak
from lightning_memkit.measure.storage import has_storage, storage_key, tensors_in
from lightning_memkit.release.phases import empty_device_cache, release_optimizer_state, storage_refs
from lightning_memkit.release.referrers import ReferrerReport, find_referrers, tensors_with_storages

__all__ = ["PhaseMemoryRelease", "PhaseReleaseResult", "MemoryRetainedError", "drop_model_log_refs"]

log = logging.getLogger(__name__)

PHASES = ("fit", "validate", "test", "predict")


class MemoryRetainedError(RuntimeError):
    """Raised by ``PhaseMemoryRelease(strict=True)`` when a phase leaves more than ``tolerance_bytes`` alive."""


@dataclass
class PhaseReleaseResult:
    """What one release did, in bytes (``None`` where nothing was measured: ``measure=False``)."""

    stage: str
    optimizer_state_bytes: int
    device_cache_bytes: int
    retained_bytes: int | None
    peak_bytes: int | None
    report: ReferrerReport | None = None
    grad_bytes: int = 0  # gradient storage freed by dropping the parameters' ``.grad``
    unsharded_bytes: int = 0  # gathered (unsharded) FSDP parameters freed by resharding


def drop_model_log_refs(callbacks: Iterable[Callback], pl_module: LightningModule) -> int:
    """Remove the ``log``/``log_dict`` bound methods of ``pl_module`` that Lightning attaches to every callback.

    Lightning sets ``callback.log = pl_module.log`` at the start of each run and never removes it, so a
    callback that outlives its trainer keeps the last model alive. Lightning attaches them again at the
    next run; attributes that are not ``pl_module``'s own bound methods are left alone. Returns how many
    were removed.
    """
    removed = 0
    for cb in callbacks:
        for name in ("log", "log_dict"):
            value = vars(cb).get(name)
            if getattr(value, "__self__", None) is pl_module and getattr(value, "__name__", None) == name:
                delattr(cb, name)
                removed += 1
    return removed


def _keys(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {storage_key(t) for t in tensors if has_storage(t)}


def _reshard(model: torch.nn.Module) -> int:
    """Reshard every FSDP unit still holding its gathered parameters; returns the bytes that this freed.

    FSDP keeps the root unit gathered after a forward without backward (validation, a no-grad call), and
    ``FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")`` keeps every unit gathered after forward. The next
    forward gathers again; the shards themselves are not touched.
    """
    if not torch.distributed.is_available():
        return 0
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    units = [m for m in model.modules() if isinstance(m, (FSDPModule, FullyShardedDataParallel))]
    if not units:
        return 0
    # FSDP2 puts its gathered parameters on the modules; FSDP1 keeps them in each handle's padded flat buffer
    handles = [u._handle for u in units if isinstance(u, FullyShardedDataParallel) and u._handle is not None]
    gathered = [h for h in handles if h.uses_sharded_strategy and not h.needs_unshard()]
    before = storage_refs([*model.parameters(), *(h._get_padded_unsharded_flat_param() for h in gathered)], skip=set())
    for unit in units:
        if isinstance(unit, FSDPModule):
            unit.reshard()  # not recursive; a no-op on a sharded unit
        elif unit._handle in gathered:
            from torch.distributed.fsdp._runtime_utils import _reshard as reshard_handle

            reshard_handle(unit, unit._handle, free_unsharded_flat_param=True)
    after = {key: ref() for key, (ref, _n) in before.items()}
    return sum(n - (after[key].nbytes() if after[key] is not None else 0) for key, (_ref, n) in before.items())


def _grad_holders(model: torch.nn.Module, pl_module: LightningModule) -> list[torch.Tensor]:
    """The tensors whose ``.grad`` a finished fit leaves: the parameters and, under ``FSDPStrategy``, each FSDP
    unit's ``FlatParameter`` (with ``use_orig_params=True`` no parameter of the model, yet it holds the gradient
    shard that the parameters' ``.grad`` are views of)."""
    holders: dict[int, torch.Tensor] = {id(p): p for p in [*pl_module.parameters(), *model.parameters()]}
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel

        for module in model.modules():
            flat = getattr(module, "_flat_param", None) if isinstance(module, FullyShardedDataParallel) else None
            if flat is not None:
                holders.setdefault(id(flat), flat)
    return list(holders.values())


class PhaseMemoryRelease(Callback):
    """Release what a finished phase keeps alive, measure what is left, and name who holds it.

    At the end (``teardown``) of each phase listed in ``after``, on every rank:

    1. every optimizer's ``state`` is cleared in place (:func:`~lightning_memkit.memory.release_optimizer_state`);
    2. the strong references the trainer keeps to finished-phase objects are dropped: the strategy's
       optimizers and ``LightningOptimizer`` wrappers (through the ``strategy.optimizers`` setter), the LR
       scheduler configs, the parameters' ``.grad``, and after ``predict`` the prediction loop's own
       reference to the predictions (the list returned to you is untouched), and the ``log``/``log_dict``
       bound methods of the model that Lightning attaches to every callback (it attaches them again at the
       next run), which would otherwise keep the model alive as long as any callback. Lightning itself already
       unwraps DDP and moves logged/callback metrics and loop results to CPU at the end of a phase. Under
       ``FSDPStrategy`` and ``ModelParallelStrategy`` (``fully_shard``) every FSDP unit still holding its
       gathered weights is resharded first (FSDP keeps the root unit gathered after a forward without
       backward, such as a final validation; ``SHARD_GRAD_OP`` keeps every unit gathered), and the
       gradient shards go too (FSDP1's ``FlatParameter`` gradients included); the parameter shards stay;
    3. garbage is collected and cached allocator blocks go back to the driver
       (:func:`~lightning_memkit.memory.empty_device_cache`);
    4. with ``measure=True`` the bytes still alive from that phase are read from a
       :class:`~lightning_memkit.memory.LivePeak` opened when the phase started (``setup``): storages created
       during the phase and still alive, except the LightningModule's parameters and buffers and the
       tensors reachable from the datamodule or the phase's dataloaders (data you keep for the next phase).
       Above ``tolerance_bytes`` a leak report (:func:`~lightning_memkit.memory.find_referrers`) naming the
       holders is logged as a warning, and ``strict=True`` raises :class:`MemoryRetainedError`.

    Resuming is unaffected: the next ``fit`` creates its optimizers again (as Lightning always does) and
    ``ckpt_path=`` restores their state. A checkpoint written *after* a released fit would hold no
    optimizer state, so ``trainer.save_checkpoint`` then raises unless ``weights_only=True``: save during
    fit (``ModelCheckpoint``) instead. Nothing here holds the model or the trainer.

    Byte counts are this rank's: a ``DTensor`` (FSDP2 parameters, gradients, optimizer state) counts its
    local shard.

    ``measure=True`` routes every tensor op of the phase through a ``TorchDispatchMode`` (a Python call per
    op); use ``measure=False`` to only release.

    Args:
        after: phases to release after; any of ``"fit"``, ``"validate"``, ``"test"``, ``"predict"``.
        tolerance_bytes: retained bytes accepted without a report.
        strict: raise instead of warning when more than ``tolerance_bytes`` is retained.
        measure: open a LivePeak at phase start to measure retained and peak bytes.
        min_report_bytes: tensors smaller than this are left out of the leak report's rows.

    Attributes:
        results: one :class:`PhaseReleaseResult` per released phase.
    """

    def __init__(
        self,
        after: str | Iterable[str] = ("fit",),
        tolerance_bytes: int = 1 << 20,
        strict: bool = False,
        measure: bool = True,
        min_report_bytes: int = 1 << 16,
    ):
        phases = (after,) if isinstance(after, str) else after
        try:
            phases = tuple(phases)
        except TypeError:
            raise TypeError(f"after must be a phase name or a sequence of them, got {type(after).__name__}") from None
        bad = [p for p in phases if p not in PHASES]
        if bad or not phases:
            raise ValueError(
                f"after={after!r} has unknown phase(s) {bad or '(none given)'}; allowed: {', '.join(PHASES)}"
            )
        check_int(tolerance_bytes, "tolerance_bytes", minimum=0, owner="PhaseMemoryRelease")  # bytes
        check_int(min_report_bytes, "min_report_bytes", minimum=0, owner="PhaseMemoryRelease")
        for name, value in (("strict", strict), ("measure", measure)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        self.after = tuple(dict.fromkeys(phases))
        self.tolerance_bytes = tolerance_bytes
        self.strict = strict
        self.measure = measure
        self.min_report_bytes = min_report_bytes
        self.results: list[PhaseReleaseResult] = []
        self._live: LivePeak | None = None
        self._optimizers_released = False

    # -- hooks -------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        stage = getattr(stage, "value", stage)
        if stage == "fit":
            self._optimizers_released = False
        self._close()
        if self.measure and stage in self.after:
            live = LivePeak()
            live.__enter__()
            self._live = live

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        stage = getattr(stage, "value", stage)
        if stage not in self.after:
            drop_model_log_refs([self], pl_module)
            return
        try:
            result = self._release(trainer, pl_module, stage)
        finally:
            self._close()
        self.results.append(result)
        self._judge(trainer, result)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close()

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if self._optimizers_released and not checkpoint.get("optimizer_states"):
            raise RuntimeError(
                "PhaseMemoryRelease released the optimizer state at the end of fit, so this checkpoint would "
                "resume with fresh optimizer state. Save checkpoints during fit (ModelCheckpoint), pass "
                "weights_only=True, or leave 'fit' out of PhaseMemoryRelease(after=...)."
            )

    # -- work --------------------------------------------------------------------------------------
    def _release(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> PhaseReleaseResult:
        strategy = trainer.strategy
        optimizers = list(strategy.optimizers)
        freed = sum(release_optimizer_state(opt) for opt in optimizers)
        if optimizers:
            self._optimizers_released = True
        del optimizers
        strategy.optimizers = []
        strategy.lr_scheduler_configs = []
        model = strategy.model if strategy.model is not None else pl_module
        unsharded = _reshard(model)  # FSDP2 puts the sharded parameters (and their .grad) back on the modules
        holders = _grad_holders(model, pl_module)
        grads = storage_refs([p.grad for p in holders if p.grad is not None], skip=set())
        pl_module.zero_grad(set_to_none=True)
        for p in holders:
            p.grad = None  # FSDP's FlatParameters too: the parameters' gradients are views into theirs
        del holders
        drop_model_log_refs(trainer.callbacks, pl_module)
        if stage == "predict":
            loop = trainer.predict_loop
            if hasattr(loop, "_predictions"):
                loop._predictions = []  # rebind: the list handed back to the caller stays intact
        cache = empty_device_cache(strategy.root_device)  # collects garbage first
        grad_bytes = sum(n for ref, n in grads.values() if ref() is None)
        live = self._live
        if live is None:
            return PhaseReleaseResult(stage, freed, cache, None, None, grad_bytes=grad_bytes, unsharded_bytes=unsharded)
        live.refresh_sizes()  # FSDP frees its unsharded parameters with resize_(0), which no op reports
        owned = _keys([*pl_module.parameters(), *pl_module.buffers()])
        owned |= _keys(tensors_in(self._data_holders(trainer), max_depth=6))
        retained = {k: n for k, n, _dev, _tag in live.live_storages() if k not in owned}
        retained_bytes = sum(retained.values())
        report = None
        if retained_bytes > self.tolerance_bytes:
            tensors = tensors_with_storages(retained)
            report = find_referrers(tensors, min_bytes=self.min_report_bytes, ignore=[self, live])
            del tensors
        return PhaseReleaseResult(stage, freed, cache, retained_bytes, live.peak_bytes, report, grad_bytes, unsharded)

    @staticmethod
    def _data_holders(trainer: Trainer) -> list[Any]:
        holders: list[Any] = [trainer.datamodule]
        for name in ("train_dataloader", "val_dataloaders", "test_dataloaders", "predict_dataloaders"):
            try:
                holders.append(getattr(trainer, name))
            except Exception:  # a property that is not available in this phase
                continue
        return [h for h in holders if h is not None]

    def _judge(self, trainer: Trainer, result: PhaseReleaseResult) -> None:
        retained = result.retained_bytes
        summary = (
            f"PhaseMemoryRelease after {result.stage}: optimizer state {result.optimizer_state_bytes} bytes freed, "
            f"gradients {result.grad_bytes} bytes freed, "
            + (f"gathered FSDP weights {result.unsharded_bytes} bytes freed, " if result.unsharded_bytes else "")
            + f"device cache {result.device_cache_bytes} bytes returned"
            + (f", {retained} bytes still alive from the phase" if retained is not None else "")
        )
        log.info(summary)
        if retained is None or retained <= self.tolerance_bytes:
            return
        message = (
            f"rank {trainer.global_rank}: {retained} bytes created during {result.stage} are still alive after the "
            f"release (tolerance_bytes={self.tolerance_bytes}).\n{result.report}"
        )
        if self.strict:
            raise MemoryRetainedError(message)
        log.warning(message)

    def memory_effect(self) -> str:
        """One line: the bytes each release so far freed (optimizer state, gradients) and handed back (cache)."""
        if not self.results:
            return (f"PhaseMemoryRelease: nothing released yet (it releases when {', '.join(self.after)} ends, at "
                    "teardown: after the end-of-fit report; see .results then)")
        parts = [f"after {r.stage}: {r.optimizer_state_bytes + r.grad_bytes + r.unsharded_bytes:,} bytes freed "
                 f"(optimizer state {r.optimizer_state_bytes:,}, gradients {r.grad_bytes:,}"
                 + (f", gathered FSDP weights {r.unsharded_bytes:,}" if r.unsharded_bytes else "")
                 + f"), device cache {r.device_cache_bytes:,} "
                 "bytes returned" + ("" if r.retained_bytes is None else f", {r.retained_bytes:,} bytes still alive")
                 for r in self.results]
        return "PhaseMemoryRelease: " + "; ".join(parts)

    def _close(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.__exit__(None, None, None)  # also correct when another dispatch mode was opened after it
