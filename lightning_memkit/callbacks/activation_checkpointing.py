"""Recompute chosen layers in backward (activation checkpointing), picked by a policy or by a memory budget.

Example::

    from lightning import Trainer
    from lightning_memkit.callbacks import ActivationCheckpointing
    from lightning_memkit.demo.tiny_lm import Block

    Trainer(callbacks=[ActivationCheckpointing()])                                     # HF decoder layers / blocks
    Trainer(callbacks=[ActivationCheckpointing(policy={Block})])                       # every Block
    Trainer(callbacks=[ActivationCheckpointing(policy={Block}, budget_bytes=2 << 30)])  # fewest Blocks under 2 GiB
    Trainer(callbacks=[ActivationCheckpointing(selective=True)])                       # keep matmul outputs
    Trainer(callbacks=[ActivationCheckpointing(selective=True, budget_bytes=2 << 30)])  # mix none/selective/full
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.seed import isolate_rng
from torch import nn

from lightning_memkit.callbacks.fit_scoped import FitScopedCallback
from lightning_memkit.common.class_paths import base_named
from lightning_memkit.common.progress import WorkProgress, progress_enabled
from lightning_memkit.common.step_output import training_loss
from lightning_memkit.common.validation import check_bool, check_int
from lightning_memkit.hf.layers import decoder_layers, kv_cache_off
from lightning_memkit.measure.allocator_peak import AllocatorPeak
from lightning_memkit.measure.compiled import runs_compiled
from lightning_memkit.measure.live_peak import LivePeak, unmeasured
from lightning_memkit.measure.saved_tensors import SavedTensorRecorder
from lightning_memkit.measure.storage import unique_storage_bytes
from lightning_memkit.recompute.activation_recompute import (
    PolicyLike,
    RecomputeHandle,
    describe_policy,
    repeated_blocks,
    resolve_policy,
)
from lightning_memkit.recompute.blocks import AUTO, choose_blocks
from lightning_memkit.recompute.budget_search import measured_full_plan, measured_mixed_plan, mode_savings
from lightning_memkit.recompute.plan import (
    CheckpointPlan,
    RecomputeCostMeter,
    calibrate,
    calibrate_activations,
)

__all__ = ["ActivationCheckpointing", "AUTO"]

_OWN_POLICY = {"DeepSpeedStrategy": "DeepSpeedStrategy(partition_activations=..., cpu_checkpointing=...)"}
_SHARDED = ("FSDPStrategy", "ModelParallelStrategy")  # recompute runs inside their units; no budget planning


def _mute(*_args: Any, **_kwargs: Any) -> None:
    """Stands in for ``log``/``log_dict`` during planning runs (one object: a compiled step is not re-guarded)."""


def _strategy_kind(strategy: Any) -> str | None:
    return base_named(strategy, (*_OWN_POLICY, *_SHARDED))


def _loss_of(output: Any) -> torch.Tensor:
    loss = training_loss(output)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise RuntimeError(
            "ActivationCheckpointing(budget_bytes=...) profiles one training_step and needs it to return a loss "
            f"tensor (or a dict with 'loss') that requires grad; got {type(loss).__name__}"
        )
    return loss


@contextlib.contextmanager
def _patched(obj: Any, **attrs: Any) -> Iterator[None]:
    """Set instance attributes for the duration of the block, then remove them again."""
    had = {name: name in vars(obj) for name in attrs}
    old = {name: vars(obj)[name] for name in attrs if had[name]}
    try:
        for name, value in attrs.items():
            setattr(obj, name, value)
        yield
    finally:
        for name in attrs:
            if had[name]:
                setattr(obj, name, old[name])
            else:
                delattr(obj, name)


class ActivationCheckpointing(FitScopedCallback):
    """Recompute the chosen submodules during backward instead of keeping their activations.

    ``policy`` picks candidate submodules. ``"auto"`` (the default) takes every Hugging Face decoder layer
    (``transformers.modeling_layers.GradientCheckpointingLayer``) in the model, otherwise the blocks of its
    longest ``nn.ModuleList`` of same-class modules (``TinyLM.blocks``), and raises if it finds neither.
    Otherwise give module classes (or class-path strings, for YAML) or a callable ``(name, module) -> bool``;
    nested matches are covered by their outermost match. Each chosen module's
    ``forward`` is wrapped with non-reentrant :func:`torch.utils.checkpoint.checkpoint` at ``on_fit_start``
    and restored at ``teardown`` (or on an exception); module names and ``state_dict`` keys never change,
    so checkpoints load with or without this callback. Works on one device, under DDP, and under
    ``FSDPStrategy`` and ``ModelParallelStrategy`` (``fully_shard`` in ``configure_model``): ``on_fit_start``
    runs after the model is wrapped, and the recompute sits inside each FSDP unit (an FSDP1-wrapped block
    stands for the module it wraps; a ``fully_shard``-ed block keeps its hooks outside the recompute), so
    the weights are gathered before it runs. A chosen module that contains an FSDP unit, ``budget_bytes``
    and ``offload`` are refused there, as is ``FSDPStrategy(activation_checkpointing_policy=...)`` together
    with this callback. DeepSpeed has its own activation checkpointing and is refused, as is a model whose
    layers already recompute themselves (HF ``activation_checkpointing_enable()``, torch's ``checkpoint_wrapper``).

    During fit the model's KV cache is off: every ``transformers`` config in the model with ``use_cache=True``
    gets ``use_cache=False`` at ``on_fit_start`` (one info line) and ``True`` again at teardown. A cache
    would keep every layer's keys and values alive for the whole step, recomputed layers included, and a
    recomputed layer would append to it a second time in backward.

    With ``budget_bytes``, the first training batch is run outside the loop (RNG, gradients and buffers
    restored, logging muted) under :class:`~lightning_memkit.measure.saved_tensors.SavedTensorRecorder`, the
    recorder behind :func:`~lightning_memkit.memory.profile_saved_tensors`: once with nothing recomputed
    (baseline peak and per-layer saved bytes) and once with every candidate recomputed (the best peak).
    A candidate's saving is the activation bytes saved inside it minus its inputs, which recomputation
    keeps; :func:`~lightning_memkit.memory.plan_checkpointing` picks the fewest layers that bring the
    step's forward+backward peak (new bytes on the training device as ``LivePeak`` counts them: weights
    and optimizer state excluded) to the budget. That prediction is then checked by measurement along
    the same largest-saving-first order (one more run per probe, usually one or two): the shortest prefix
    of that order whose *measured* peak is within budget is kept; the layers and the predicted and measured peaks are
    printed. A budget that even recomputing every candidate cannot reach raises ``ValueError`` with the
    best achievable peak. Each ``fit`` plans again on its first batch.

    ``selective=True`` recomputes selectively (selective activation checkpointing): each chosen layer keeps
    the outputs of its matmuls and attention kernels (:data:`~lightning_memkit.recompute.activation_recompute.
    SAVED_OPS`) besides its inputs and recomputes only the rest in backward, so no matmul runs twice: less
    saved than with full recompute, for much less time. With ``budget_bytes`` too, each layer gets none,
    selective or full recompute: the planning runs also measure every layer selectively recomputed and the
    time of each layer's forward ops (full) and of its non-matmul ops (selective), and
    :func:`~lightning_memkit.memory.plan_recompute` picks the assignment with the least predicted recompute
    time whose predicted peak fits (selective first, full only where needed; a layer's full recompute is
    charged after the later layers' backward has freed their activations); the plan is then measured and
    re-planned for a target lowered by a measured overshoot or raised by a measured slack (up to four measured
    plans; the cheapest that fits is kept, else every layer in full). ``memory_effect()`` and ``modes`` say
    which layer got which mode.

    A ``torch.compile``d model works: a compiled LightningModule passed to ``Trainer.fit`` or compiled
    submodules. The callback patches the original modules, so the recompute is traced into the compiled
    graph (one recompilation). With ``budget_bytes``, the saved-tensor profile runs eager (compiled code
    cannot be profiled per layer), and the peaks that decide are measured on the compiled step by the
    allocator (:class:`~lightning_memkit.measure.allocator_peak.AllocatorPeak`: the CPU allocator's events
    through ``torch.profiler``, ``max_memory_allocated`` on CUDA); the profiled savings are scaled to them.
    Each measured configuration compiles once.

    ``offload=True`` (CUDA only; an error elsewhere) also runs ``training_step`` under
    ``torch.autograd.graph.save_on_cpu(pin_memory=True)``: what the non-recomputed parts save for backward
    goes to pinned host memory.

    Args:
        policy: ``"auto"``, module classes / class paths, or a callable ``(name, module) -> bool``.
        budget_bytes: step peak to reach with the fewest recomputed layers (``None``: recompute all matches).
        offload: move saved activations to pinned CPU memory (CUDA).
        selective: recompute selectively (keep matmul and attention outputs); with ``budget_bytes``, mix none,
            selective and full per layer. A bool rather than a mode string because with a budget it allows
            selective recompute, mixed with full where needed, instead of forcing one mode.

    Attributes:
        plan: the :class:`~lightning_memkit.memory.CheckpointPlan` (budget mode), else ``None``.
        checkpointed: names of the modules recomputed in the current (or last) fit.
        modes: name -> ``"full"`` or ``"selective"`` for each of them.
        measured_peak_bytes: the measured step peak with the plan applied, on the first batch (budget mode).
    """

    def __init__(
        self, policy: PolicyLike = AUTO, budget_bytes: int | None = None, offload: bool = False, selective: bool = False
    ):
        if policy != AUTO:
            resolve_policy(policy)  # validates and imports class paths now
        check_int(budget_bytes, "budget_bytes", minimum=1, allow_none=True, owner="ActivationCheckpointing")
        if not isinstance(offload, bool):
            raise TypeError(f"offload must be a bool, got {type(offload).__name__}")
        check_bool(selective, "selective", owner="ActivationCheckpointing")
        if offload and not torch.cuda.is_available():
            raise ValueError(
                "offload=True moves saved activations from a CUDA device to pinned CPU memory, but CUDA is not "
                "available here; set offload=False"
            )
        self.policy = policy
        self.budget_bytes = budget_bytes
        self.offload = offload
        self.selective = selective
        self.plan: CheckpointPlan | None = None
        self.checkpointed: list[str] = []
        self.modes: dict[str, str] = {}
        self.measured_peak_bytes: int | None = None
        self._handle = RecomputeHandle()
        self._candidates: list[tuple[str, weakref.ref]] = []
        self._needs_plan = False
        self._device: str = "cpu"
        self._compiled = False
        self._offload_patch: contextlib.ExitStack | None = None
        self._cache_patch: contextlib.ExitStack | None = None
        self._progress = WorkProgress("ActivationCheckpointing planning run", enabled=False)

    # -- hooks -------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        kind = _strategy_kind(trainer.strategy)
        if kind in _OWN_POLICY:
            raise ValueError(
                f"ActivationCheckpointing does not run under {kind}, which checkpoints activations itself: use "
                f"{_OWN_POLICY[kind]} with policy {describe_policy(self.policy)} and remove this callback"
            )
        if kind in _SHARDED:
            self._check_sharded(trainer, kind)
        if self.budget_bytes is not None and not pl_module.automatic_optimization:
            raise ValueError(
                "ActivationCheckpointing(budget_bytes=...) profiles a training_step outside the loop and needs "
                "automatic optimization; with manual optimization pass budget_bytes=None"
            )

    def _check_sharded(self, trainer: Trainer, kind: str) -> None:
        """What cannot run under FSDPStrategy / ModelParallelStrategy, refused before the model is sharded."""
        if self.budget_bytes is not None:
            raise ValueError(
                f"ActivationCheckpointing(budget_bytes={self.budget_bytes}) plans on one device and does not run "
                f"under {kind}: its planning runs would step outside the sharded forward/backward. Pass "
                "budget_bytes=None (recompute every policy match) or plan on one device first and pass those "
                "layers' class as policy"
            )
        if self.offload:
            raise ValueError(
                f"ActivationCheckpointing(offload=True) does not run under {kind}: save_on_cpu would also copy "
                "each gathered (unsharded) weight saved for backward to host memory. Use the strategy's own CPU "
                "offload (FSDPStrategy(cpu_offload=True), fully_shard(offload_policy=CPUOffloadPolicy())) and "
                "offload=False"
            )
        if getattr(trainer.strategy, "_activation_checkpointing_kwargs", None):
            raise ValueError(
                "FSDPStrategy(activation_checkpointing_policy=...) already recomputes layers; use either it or "
                "ActivationCheckpointing, not both"
            )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        chosen = self._select(pl_module)
        device = trainer.strategy.root_device
        if self.offload and device.type != "cuda":
            raise ValueError(
                f"offload=True moves saved activations from a CUDA device to pinned CPU memory, but training runs "
                f"on {device}; set offload=False"
            )
        self._device = str(device)
        self._compiled = runs_compiled(pl_module)
        self._candidates = [(name, weakref.ref(m)) for name, m in chosen]
        self.checkpointed, self.modes = [], {}
        self.measured_peak_bytes = None
        if self.budget_bytes is None:
            self._wrap(dict.fromkeys((name for name, _ in chosen), "selective" if self.selective else "full"))
        else:
            self._needs_plan = True  # every fit plans again: the model, batch or precision may have changed
        if self.offload:
            self._patch_offload(pl_module)
        self._cache_off(pl_module)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._needs_plan:
            return
        self._needs_plan = False
        self._progress = WorkProgress("ActivationCheckpointing planning run", enabled=progress_enabled(trainer))
        with unmeasured():  # the planning runs are no part of this step's peak (PeakMemoryMonitor)
            plan, measured = self._make_plan(trainer, pl_module, batch, batch_idx)
        self.plan, self.measured_peak_bytes = plan, measured
        self._wrap(plan.modes)
        if measured > plan.budget_bytes:
            rank_zero_warn(plan_message(plan, measured))
        else:
            rank_zero_info(plan_message(plan, measured))

    def memory_effect(self) -> str:
        """One line: the layers recomputed and, with a budget, the activation bytes recomputed instead of kept."""
        if not self.checkpointed:
            return "ActivationCheckpointing: no layer recomputed"
        head = f"ActivationCheckpointing: {len(self.checkpointed)} layers recomputed ({_layer_list(self.modes)})"
        plan = self.plan
        if plan is None:
            return f"{head}; activation bytes saved not measured (budget_bytes=None: nothing was profiled)"
        saved = plan.saved_bytes
        return (f"{head}; {saved:,} activation bytes recomputed in backward instead of kept (measured by the "
                f"planning runs on the first batch); step peak {plan.baseline_peak:,} -> {self.measured_peak_bytes:,} "
                f"bytes measured, budget {plan.budget_bytes:,} bytes")

    # -- work --------------------------------------------------------------------------------------
    def _select(self, pl_module: LightningModule) -> list[tuple[str, nn.Module]]:
        """The candidate modules (:func:`~lightning_memkit.recompute.blocks.choose_blocks`); raises when nothing
        matches, when they already recompute themselves or when one holds an FSDP unit.

        Names are those of the unwrapped model (``blocks.0``, also under ``FSDPStrategy``); an FSDP1 unit
        chosen (``policy="auto"`` finds the ``ModuleList`` of wrapped blocks) stands for the module it wraps.
        """
        return choose_blocks(pl_module, self.policy, owner="ActivationCheckpointing",
                             finders=(decoder_layers, repeated_blocks))

    def _cache_off(self, pl_module: LightningModule) -> None:
        stack = contextlib.ExitStack()
        configs = stack.enter_context(kv_cache_off(pl_module))
        self._cache_patch = stack
        if configs:
            names = ", ".join(sorted({type(c).__name__ for c in configs}))
            rank_zero_info(f"ActivationCheckpointing: KV cache off during fit (use_cache=False on {names})")

    def _modules(self, names: list[str]) -> list[tuple[str, nn.Module]]:
        by_name = dict(self._candidates)
        out = []
        for name in names:
            module = by_name[name]()
            if module is None:
                raise RuntimeError(f"module {name!r} was garbage-collected before it could be checkpointed")
            out.append((name, module))
        return out

    def _wrap(self, modes: dict[str, str]) -> None:
        self._handle.add(self._modules(list(modes)), modes)
        self.checkpointed, self.modes = list(modes), dict(modes)

    def _patch_offload(self, pl_module: LightningModule) -> None:
        step = pl_module.training_step

        @functools.wraps(step)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                return step(*args, **kwargs)

        stack = contextlib.ExitStack()
        stack.enter_context(_patched(pl_module, training_step=training_step))
        self._offload_patch = stack

    def _restore(self) -> None:
        self._handle.restore()
        self._needs_plan = False
        for stack in (self._offload_patch, self._cache_patch):
            if stack is not None:
                stack.close()
        self._offload_patch = self._cache_patch = None

    def _device_peak(self, live: LivePeak) -> int:
        dev = live.by_device.get(self._device)
        return dev.peak if dev is not None else live.peak_bytes

    def _make_plan(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> tuple[CheckpointPlan, int]:
        """Profile the step (nothing, every candidate in each mode), then plan and check by measurement."""
        names = [name for name, _ in self._candidates]
        every = {mode: dict.fromkeys(names, mode) for mode in (("selective", "full") if self.selective else ("full",))}
        run = functools.partial(self._profile, trainer, pl_module, batch, batch_idx)
        baseline, acts, inputs, costs = run({}, meter=self.selective)
        profiled, kept = {"none": baseline}, {}
        for mode, modes in every.items():
            profiled[mode], kept[mode], _, _ = run(modes)
        savings = mode_savings(acts, inputs, kept.get("selective"))
        peak = functools.partial(self._runtime_peak, trainer, pl_module, batch, batch_idx)
        measured = {"none": peak({}), **{m: peak(modes) for m, modes in every.items()}} if self._compiled else {}
        measured = measured or dict(profiled)
        for peaks in (profiled, measured):
            peaks.setdefault("selective", peaks["none"])
        overhead = {m: max(0, profiled[m] - (baseline - sum(r[m] for r in savings.values() if r[m] > 0)))
                    for m in ("selective", "full")}
        acts = calibrate_activations(acts, savings, overhead, measured)  # freed before an earlier full recompute
        baseline, savings, overhead = calibrate(savings, overhead, measured)
        if self.selective:
            return measured_mixed_plan(savings, baseline, overhead, costs, measured, peak, self.budget_bytes, names,
                                       acts)
        return measured_full_plan({n: r["full"] for n, r in savings.items()}, baseline, overhead["full"], measured,
                                  peak, self.budget_bytes)

    @contextlib.contextmanager
    def _isolated(self, pl_module: LightningModule, modes: dict[str, str]) -> Iterator[list[tuple[str, nn.Module]]]:
        """A planning run: ``modes`` applied, RNG, gradients and buffers restored after, logging muted."""
        candidates = self._modules([name for name, _ in self._candidates])
        grads = [(p, p.grad) for p in pl_module.parameters()]
        buffers = [(b, b.detach().clone()) for b in pl_module.buffers()]
        handle = RecomputeHandle()
        try:
            handle.add([(n, m) for n, m in candidates if n in modes], modes)
            with isolate_rng(), _patched(pl_module, log=_mute, log_dict=_mute):
                yield candidates
        finally:
            handle.restore()
            for p, g in grads:
                p.grad = g
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)

    def _step(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
              rec: SavedTensorRecorder | None = None) -> torch.Tensor:
        """``training_step`` and its backward (without DDP's gradient sync); ``rec`` is stopped in between."""
        model = trainer.strategy.model
        no_sync = model.no_sync if hasattr(model, "no_sync") else contextlib.nullcontext
        with trainer.strategy.precision_plugin.train_step_context():
            loss = _loss_of(pl_module.training_step(batch, batch_idx))
        if rec is not None:
            rec.stop()
        with no_sync():
            loss.backward()
        return loss

    def _runtime_peak(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, modes: dict[str, str]
    ) -> int:
        """The step's peak as it really runs: LivePeak (eager), or the allocator's count of the compiled step."""
        if not self._compiled:
            return self._profile(trainer, pl_module, batch, batch_idx, modes)[0]
        self._progress.step(f"(compiled, {len(modes)} of {len(self._candidates)} layers recomputed)")
        with self._isolated(pl_module, modes):
            self._step(trainer, pl_module, batch, batch_idx)  # compiles this configuration: not measured
        with self._isolated(pl_module, modes), AllocatorPeak(self._device) as counter:
            self._step(trainer, pl_module, batch, batch_idx)
        return counter.peak_bytes

    def _profile(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, modes: dict[str, str],
        meter: bool = False,
    ) -> tuple[int, dict[str, int], dict[str, int], dict[str, dict[str, float]]]:
        """One eager forward+backward of ``training_step`` outside the loop: peak, per-candidate activations and
        inputs, and (``meter``) each candidate's recompute time per mode.

        The recorder runs compiled code eagerly (``torch.compiler.set_stance("force_eager")``): per-layer bytes
        need the eager forward, and the compiled entries stay in place for the training steps.
        """
        self._progress.step(f"({len(modes)} of {len(self._candidates)} layers recomputed)")
        inputs: Counter = Counter()
        with self._isolated(pl_module, modes) as candidates:
            hooks = [m.register_forward_pre_hook(self._input_counter(name, inputs), with_kwargs=True)
                     for name, m in candidates]
            timer = RecomputeCostMeter(candidates) if meter else contextlib.nullcontext()
            try:
                with torch.compiler.set_stance("force_eager"), timer, SavedTensorRecorder(pl_module) as rec:
                    loss = self._step(trainer, pl_module, batch, batch_idx, rec)
                    report = rec.report(output=loss, include_peak=True)
                    peak = self._device_peak(rec.live_peak)
                    del loss
            finally:
                for h in hooks:
                    h.remove()
        acts = {name: sum(r.activation_bytes for r in report.rows if _related_row(r.name, name))
                for name, _ in candidates}
        return peak, acts, dict(inputs), timer.costs if meter else {}

    @staticmethod
    def _input_counter(name: str, counts: Counter) -> Callable:
        def hook(_module: nn.Module, args: Any, kwargs: Any) -> None:
            counts[name] += unique_storage_bytes((args, kwargs))

        return hook


def _related_row(row: str, name: str) -> bool:
    """Whether a saved-tensor report row belongs to candidate ``name`` (itself or inside it; ``""``: everything)."""
    return not name or row == name or row.startswith(name + ".")


def _layer_list(modes: dict[str, str], shown: int = 4) -> str:
    """``blocks.0, blocks.1, ...`` (all full) or ``blocks.0 (selective), blocks.1 (full), ...`` (mixed)."""
    mixed = any(mode != "full" for mode in modes.values())
    items = [f"{name} ({mode})" if mixed else name for name, mode in modes.items()]
    return ", ".join(items[:shown]) + (", ..." if len(items) > shown else "") or "none"


def plan_message(plan: CheckpointPlan, measured: int) -> str:
    """The plan in words, saying plainly whether the measured peak reaches the budget and how the prediction compares.

    Example::

        >>> from lightning_memkit.memory import plan_checkpointing
        >>> plan = plan_checkpointing({"a": 30, "b": 50}, baseline_peak=200, budget_bytes=160)
        >>> print(plan_message(plan, measured=170))  # doctest: +NORMALIZE_WHITESPACE
        ActivationCheckpointing: recomputing 1 of 2 layers (b); budget 160 bytes NOT reached with this plan: step
        peak measured 170 bytes (predicted 150 bytes; nothing recomputed: 200 bytes)
    """
    head = f"ActivationCheckpointing: recomputing {len(plan.layers)} of {len(plan.savings)} layers " \
           f"({_layer_list(plan.modes, shown=len(plan.layers))}); "
    tail = f"(predicted {plan.predicted_peak} bytes; nothing recomputed: {plan.baseline_peak} bytes)"
    if measured > plan.budget_bytes:
        return (f"{head}budget {plan.budget_bytes} bytes NOT reached with this plan: step peak measured {measured} "
                f"bytes {tail}")
    note = ""
    if plan.predicted_peak > plan.budget_bytes:
        note = f"; the prediction {plan.predicted_peak} bytes is above the budget, the measured peak decides"
    return (f"{head}step peak measured {measured} bytes, within the budget of {plan.budget_bytes} bytes {tail}{note}")
