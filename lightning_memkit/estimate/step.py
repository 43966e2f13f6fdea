"""Predict the device memory of a training step before renting the device: the real step, run on fake tensors.

:func:`estimate_training_memory` builds the model from a factory under
:class:`torch._subclasses.FakeTensorMode` (tensors with shapes, dtypes and storage sizes, and no memory),
then runs two training steps of the real code (forward with the loss, backward, ``optimizer.step``) and
counts every live storage the way :class:`~lightning_memkit.memory.LivePeak` counts them on a real device
(unique storages, freed when they die), from before the model is built. The first step allocates the
optimizer state; the second is the steady-state step that is reported, per phase:

- **load**: building the model (weights and buffers, in the training dtype);
- **forward**: from the step's start (batch on the device) to the loss; as in Lightning's automatic
  optimization, the previous step's gradients are still alive (``zero_grad(set_to_none=True)`` runs
  between forward and backward; ``zero_grad="before_forward"`` for a plain loop that drops them first);
- **backward**: ``loss.backward()`` (after that ``zero_grad``);
- **optimizer step**: ``optimizer.step()`` (its temporaries included).

Each phase gives its peak and the split of that peak into weights, gradients, optimizer state, saved
activations (what autograd keeps for backward), loss/logits (what is allocated after the model's last
repeated block: head, logits, loss) and transient, with the module running at the peak.

Features run as they really behave: ``checkpoint`` recomputes the chosen blocks with
:func:`~lightning_memkit.memory.checkpoint_modules`, ``patches`` enter any context manager around the steps
(a fused loss, the KV cache off), and MoE expert modules get a stated routing. What is assumed is listed
in :attr:`MemoryEstimate.assumptions`.

Example::

    >>> import torch
    >>> from lightning_memkit.memory import estimate_training_memory
    >>> def model():
    ...     return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    >>> est = estimate_training_memory(model, lambda: torch.randn(64, 1024),
    ...                                loss_fn=lambda m, x: m(x).square().mean(), optimizer="sgd")
    >>> [p.phase for p in est.phases]
    ['load', 'forward', 'backward', 'optimizer step']
    >>> est.phases[0].weights                     # (1024*1024 + 1024 + 10*1024 + 10) float32 parameters
    4239400
    >>> est.peak_bytes > 3 * est.phases[0].weights  # weights, gradients, momentum, activations
    True
"""

from __future__ import annotations

import contextlib
import inspect
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from lightning_memkit.common.step_output import training_loss
from lightning_memkit.common.validation import check_bool, check_choice
from lightning_memkit.estimate.fast_ops import FastOps
from lightning_memkit.estimate.step_spec import StepSpec
from lightning_memkit.estimate.trace import (
    CategoryTracker,
    EventLog,
    FakeKernelGaps,
    ModuleClock,
    PhasePeak,
    fake_tensors,
)
from lightning_memkit.measure.storage import format_bytes, has_storage, iter_tensors, storage_key
from lightning_memkit.recompute.activation_recompute import (
    PolicyLike,
    checkpoint_modules,
    repeated_blocks,
    resolve_policy,
    select_modules,
)

__all__ = ["MemoryEstimate", "PhaseEstimate", "estimate_training_memory", "OPTIMIZERS", "PRECISIONS",
           "configured_optimizer", "step_loss"]

OPTIMIZERS = ("adamw", "sgd")
PRECISIONS = ("32-true", "32", "bf16-true", "16-true", "bf16-mixed")
STEP_PHASES = ("forward", "backward", "optimizer step")
ZERO_GRAD = ("after_forward", "before_forward", "accumulate")
CHECKPOINT_MODES = ("full", "selective")
TARGETS = ("cpu", "cuda")
_COLUMNS = ("peak", "weights", "grads", "optim state", "saved", "loss/logits", "transient")  # short: 120 columns
_OWNER = "estimate_training_memory"


@dataclass
class PhaseEstimate:
    """One phase: its predicted peak and what is alive at that peak, by category, and the module running."""

    phase: str
    peak_bytes: int
    weights: int
    gradients: int
    optimizer_state: int
    saved_activations: int
    loss_logits: int
    transient: int
    peak_layer: str

    @classmethod
    def from_peak(cls, phase: str, peak: PhasePeak) -> PhaseEstimate:
        s = peak.split
        return cls(phase, peak.peak_bytes, s["weights"], s["gradients"], s["optimizer state"],
                   s["saved activations"], s["loss/logits"], s["transient"], peak.layer)


@dataclass
class MemoryEstimate:
    """What :func:`estimate_training_memory` predicts; ``peak_bytes`` is the steady-state step's peak."""

    phases: list[PhaseEstimate]
    peak_bytes: int
    parameters: int
    trainable_parameters: int
    precision: str
    optimizer: str
    features: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    seconds: float = 0.0
    step_flops: int = 0  # matmul/attention FLOPs of the step (FlopCount), recomputation included
    step_bytes: int = 0  # bytes of the storages the step creates (what its memory-bound ops write)
    host_bytes: int = 0  # the step's peak of host memory (offloaded bytes), apart from the device peak_bytes
    optimizer_step_bytes: int = 0  # of step_bytes, those optimizer.step() creates (once per optimizer step)
    host_steady_bytes: int = 0  # of host_bytes, those alive through the step (an offloaded optimizer's state)
    parameter_bytes: int = 0  # the parameters' bytes as this rank holds them (its shards), on the device or the host
    largest_tensor: dict[str, Any] = field(default_factory=dict)  # the step's largest storage: bytes, shape, module

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        """The estimate as JSON (``peak_bytes`` first-level, one object per phase)."""
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> Any:
        """A ``rich`` table: per phase, the peak and its split, and the module running at the peak."""
        from rich.table import Table

        table = Table(title=f"memkit estimate: {self.parameters:,} parameters ({self.trainable_parameters:,} "
                      f"trainable), {self.precision}, {self.optimizer}",
                      caption=f"steady-state step peak: {format_bytes(self.peak_bytes)} ({self.peak_bytes:,} B)"
                      + (f"; features: {', '.join(self.features)}" if self.features else ""),
                      title_justify="left", caption_justify="left")
        table.add_column("phase", no_wrap=True)
        for name in _COLUMNS:
            table.add_column(name, justify="right", no_wrap=True)
        for p in self.phases:
            cells = [p.peak_bytes, p.weights, p.gradients, p.optimizer_state, p.saved_activations, p.loss_logits,
                     p.transient]
            table.add_row(p.phase, *(format_bytes(c) for c in cells))
        return table

    def notes(self) -> str:
        """Lines under the table: where each phase peaks, the assumptions, the time taken."""
        where = [f"{p.phase} peaks in {p.peak_layer}" for p in self.phases[1:] if p.peak_layer]
        lines = [f"{'; '.join(where)}"] if where else []
        if self.host_bytes:
            lines.append(f"host memory (offloaded) at its step peak: {format_bytes(self.host_bytes)}")
        lines += [f"assumption: {a}" for a in self.assumptions]
        return "\n".join([*lines, f"estimated in {self.seconds:.1f} s"])

    def __str__(self) -> str:
        from lightning_memkit.measure.report import render_text

        return render_text(self.table()).rstrip() + "\n" + self.notes()


# -- arguments ---------------------------------------------------------------------------------------------
def resolve_optimizer(optimizer: Any, kwargs: Mapping[str, Any] | None) -> tuple[Callable[[nn.Module], Any], str]:
    """``(make(model) -> Optimizer over its trainable parameters, name)``."""
    def trainable(model: nn.Module) -> list[nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]

    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        args = {"lr": 1e-3, **(kwargs or {})}
        return lambda m: optimizer(trainable(m), **args), optimizer.__name__
    if callable(optimizer) and not isinstance(optimizer, type):
        return optimizer, getattr(optimizer, "__name__", "optimizer")
    check_choice(optimizer, "optimizer", OPTIMIZERS, owner=_OWNER)
    if optimizer == "sgd":
        args = {"lr": 1e-3, "momentum": 0.9, **(kwargs or {})}
        return lambda m: torch.optim.SGD(trainable(m), **args), "SGD(momentum=0.9)"
    args = {"lr": 1e-3, **(kwargs or {})}
    return lambda m: torch.optim.AdamW(trainable(m), **args), "AdamW"


def precision_dtype(precision: str) -> torch.dtype:
    """The dtype of a ``"*-true"`` precision: bfloat16, float16, else float32."""
    return {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision, torch.float32)


def _check_args(model_factory: Any, batch_factory: Any, loss_fn: Any, precision: Any, checkpoint: Any,
                patches: Sequence[Any], expert_balance: Any) -> None:
    for name, value in (("model_factory", model_factory), ("batch_factory", batch_factory)):
        if not callable(value):
            raise TypeError(f"{_OWNER}({name}=...) must be callable, got {type(value).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"{_OWNER}(loss_fn=...) must be callable or None, got {type(loss_fn).__name__}")
    check_choice(precision, "precision", PRECISIONS, owner=_OWNER)
    check_choice(expert_balance, "expert_balance", ("uniform",), owner=_OWNER)
    if checkpoint not in (None, "auto"):
        resolve_policy(checkpoint)  # raises naming what is allowed
    for i, patch in enumerate(patches):
        if not callable(patch):
            raise TypeError(f"{_OWNER}(patches=...): entry {i} must be a callable model -> context manager, "
                            f"got {type(patch).__name__}")


def _check_plugin(plugin: Any, precision: str) -> None:
    if plugin is None:
        return
    missing = [m for m in ("convert_module", "forward_context") if not callable(getattr(plugin, m, None))]
    if missing:
        raise TypeError(f"{_OWNER}(plugin=...) must be a Lightning precision plugin; {type(plugin).__name__} has no "
                        f"{', '.join(missing)}")
    if precision != "32-true":
        raise ValueError(f"{_OWNER}: plugin={type(plugin).__name__} sets the precision itself (as in a Trainer, "
                         f"which refuses both); leave precision='32-true', got {precision!r}")


# -- the step ------------------------------------------------------------------------------------------------
def step_loss(module: Any, batch: Any) -> torch.Tensor:
    """``module.training_step(batch, 0)``, or its ``"loss"`` when it returns a dict."""
    return training_loss(module.training_step(batch, 0))


def configured_optimizer(module: Any) -> torch.optim.Optimizer:
    """The first optimizer of ``module.configure_optimizers()`` (an optimizer, a list, a dict or a pair of lists)."""
    out = module.configure_optimizers()
    if isinstance(out, dict):
        out = out["optimizer"]
    if isinstance(out, (list, tuple)):
        out = out[0][0] if isinstance(out[0], (list, tuple)) else out[0]
    return out


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple or list, else ``model(batch)``; then its
    loss: the tensor itself, its ``.loss`` (Hugging Face outputs) or its ``["loss"]``."""
    if isinstance(batch, Mapping):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    if isinstance(out, Mapping) and "loss" in out:
        out = out["loss"]
    loss = getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"{_OWNER}: the model returned {type(out).__name__} and no scalar loss; pass loss_fn=")
    return loss


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``torch.set_default_dtype(dtype)`` for the block."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _forward_context(precision: str) -> Any:
    if precision == "bf16-mixed":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return default_dtype(precision_dtype(precision))


@dataclass
class _Run:
    """The objects of one estimate while it runs."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    tracker: CategoryTracker
    batch_factory: Callable[[], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    precision: str
    zero_grad: str
    gaps: FakeKernelGaps
    plugin: Any = None
    fake_batch: bool = False
    before_step: Callable[[], None] | None = None  # called before the recorded optimizer step (EventLog claims)
    grads: dict[str, tuple[int, torch.dtype]] = field(default_factory=dict)  # made by the last backward


def _classify_static(run: _Run) -> None:
    tr = run.tracker
    tr.move(list(run.model.parameters()) + list(run.model.buffers()), "weights")
    tr.move([p.grad for p in run.model.parameters() if p.grad is not None], "gradients")
    tr.move(list(iter_tensors(list(run.optimizer.state.values()))), "optimizer state")


def _pack_saved(tracker: CategoryTracker) -> Callable[[torch.Tensor], torch.Tensor]:
    keep = ("weights", "gradients", "optimizer state", "loss/logits")

    def pack(t: torch.Tensor) -> torch.Tensor:
        tracker.move([t], "saved activations", unless=keep)
        return t

    return pack


def _step(run: _Run, record: bool) -> None:
    """One training step: batch, forward, ``zero_grad`` (Lightning's order; or before the forward), backward,
    ``step``."""
    tr = run.tracker
    _classify_static(run)
    # real values (labels checked, masks and counts read), unless the batch is fake too: no memory for it
    with contextlib.nullcontext() if run.fake_batch else unset_fake_temporarily():
        batch = run.batch_factory()
    if run.zero_grad == "before_forward":
        run.optimizer.zero_grad(set_to_none=True)
    tr.start_phase("forward" if record else None, "transient")
    first = tr.serial
    if run.plugin is not None and hasattr(run.plugin, "convert_input"):
        batch = run.plugin.convert_input(batch)
    context = run.plugin.forward_context() if run.plugin is not None else _forward_context(run.precision)
    with context, torch.autograd.graph.saved_tensors_hooks(_pack_saved(tr), _identity):
        loss = run.loss_fn(run.model, batch)
    tr.move_since(first, "transient", "saved activations")
    if run.zero_grad == "after_forward":
        run.optimizer.zero_grad(set_to_none=True)
    tr.start_phase("backward" if record else None, "transient")
    run.grads.clear()  # filled as each gradient completes (_record_gradients' hooks)
    loss.backward()
    del loss
    if record and run.before_step is not None:
        run.before_step()
    tr.start_phase("optimizer step" if record else None, "transient")
    run.optimizer.step()
    tr.start_phase(None, "transient")
    del batch


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


# -- model hooks ------------------------------------------------------------------------------------------------
def _loss_region_hook(model: nn.Module, tracker: CategoryTracker) -> Any:
    """After the last repeated block's forward, new storages are the head's and the loss's."""
    blocks = repeated_blocks(model)
    if not blocks:
        return None

    def hook(_module: nn.Module, _args: Any, _out: Any) -> None:
        if torch._C._current_autograd_node() is None and tracker.category == "transient":  # not a recompute
            tracker.category = "loss/logits"

    return blocks[-1][1].register_forward_hook(hook)


def _expert_modules(model: nn.Module) -> list[nn.Module]:
    """Modules holding stacked expert weights: a ``num_experts`` int and 3-D parameters of their own, or children
    with the same ``num_experts`` (quantized experts)."""
    return [m for m in model.modules() if isinstance(getattr(m, "num_experts", None), int)
            and (any(p.dim() == 3 for p in m.parameters(recurse=False))  # a quantized one: per-expert children
                 or any(getattr(c, "num_experts", None) == m.num_experts for c in m.children()))]


def _install(run: _Run, clock: ModuleClock, checkpoint: tuple[PolicyLike | None, str],
             stack: contextlib.ExitStack) -> tuple[list[str], list[str]]:
    """Hooks and recomputation, undone by ``stack``; returns the feature names to go before and after the
    patches' (:func:`_patch`)."""
    model, features = run.model, []
    clock.install()
    stack.callback(clock.remove)
    handles = [_loss_region_hook(model, run.tracker)]
    experts = _expert_modules(model)
    routing = run.gaps.routing
    handles += [m.register_forward_pre_hook(routing.enter, with_kwargs=True) for m in experts]
    handles += [m.register_forward_hook(routing.leave, always_call=True) for m in experts]
    for p in model.parameters():
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(
                lambda q: run.tracker.move([q.grad], "gradients")))
    stack.callback(lambda: [h.remove() for h in handles if h is not None])
    policy, mode = checkpoint
    if policy is not None:
        chosen = repeated_blocks(model) if policy == "auto" else select_modules(model, policy)
        if not chosen:
            raise ValueError(f"{_OWNER}(checkpoint='auto'): {type(model).__name__} has no nn.ModuleList of "
                             "same-class blocks; pass module classes or a (name, module) -> bool policy")
        stack.enter_context(checkpoint_modules(chosen, mode=mode))
        features.append(f"{'selective ' if mode == 'selective' else ''}activation checkpointing "
                        f"({len(chosen)} modules)")
    if run.plugin is not None:
        features.append(repr(run.plugin))
    return features, [f"{len(experts)} MoE expert modules"] if experts else []


def _patch(model: nn.Module, patches: Sequence[Callable[[nn.Module], Any]], stack: contextlib.ExitStack) -> list[str]:
    """Enter ``patches`` on ``model`` (undone by ``stack``); returns their names."""
    for patch in patches:
        stack.enter_context(patch(model))
    return [getattr(patch, "__name__", type(patch).__name__) for patch in patches]


def build_model(model_factory: Callable[[], nn.Module], precision: str, plugin: Any = None,
                built: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """``model_factory()`` in training mode, as Lightning prepares it: built under ``precision``'s dtype and cast
    to it (``"bf16-true"``, ``"16-true"``), then converted by the precision ``plugin`` (``convert_module``).
    ``built`` is called with the model as the factory returns it."""
    with default_dtype(precision_dtype(precision)):
        model = model_factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"{_OWNER}(model_factory=...) must return a torch.nn.Module, got {type(model).__name__}")
    if built is not None:
        built(model)
    if precision in ("bf16-true", "16-true"):
        model = model.to(precision_dtype(precision))
    if plugin is not None:
        model = plugin.convert_module(model)
    return model.train()


def _foreach_step_bytes(optim: torch.optim.Optimizer, tracker: CategoryTracker) -> int:
    """On CUDA ``optimizer.step()`` runs its ``foreach`` implementation: the bytes its temporaries take beyond the
    CPU path's, which they replace. Not for parameters in host memory (FSDP2's offloaded shards): they step on the
    host, one by one."""
    from lightning_memkit.pipeline.cost import optimizer_step_bytes

    params = [_local(p) for g in optim.param_groups for p in g["params"] if p.requires_grad]
    params = [p for p in params if not tracker.on_host(p)]
    if not params or type(optim).__name__.lower() not in ("adam", "adamw", "sgd"):
        return 0
    group = optim.param_groups[0]
    hp = {k: group[k] for k in ("weight_decay", "maximize", "nesterov") if k in group}
    return (optimizer_step_bytes(params, type(optim), foreach=True, **hp)
            - optimizer_step_bytes(params, type(optim), foreach=False, **hp))


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``p``: its shard where ``p`` is sharded (a ``DTensor``)."""
    return p.to_local() if hasattr(p, "to_local") else p


def _assumptions(experts: bool, target: str = "cpu", replicas: bool = False) -> list[str]:
    notes = ["unique tensor storages as LivePeak counts them (not included: CUDA allocator rounding, cuBLAS and "
             "attention kernel workspaces, the CUDA context)"]
    if target == "cuda":
        notes.append("CUDA: optimizer.step() runs its foreach implementation (temporaries from "
                     "optimizer_step_bytes); every other op's outputs as the CPU kernels shape them")
    if experts:
        notes.append("MoE routing: uniform expert balance, each expert gets tokens * top_k / num_experts tokens")
    if replicas:
        notes.append("DDP: each replica's reducer holds one flat copy of the trainable gradients from the start "
                     "(gradient_as_bucket_view=False, the default)")
    return notes


def estimate_training_memory(
    model_factory: Callable[[], nn.Module],
    batch_factory: Callable[[], Any],
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    optimizer: str | type = "adamw",
    optimizer_kwargs: Mapping[str, Any] | None = None,
    precision: str = "32-true",
    checkpoint: PolicyLike | None = None,
    patches: Sequence[Callable[[nn.Module], Any]] = (),
    expert_balance: str = "uniform",
    zero_grad: str = "after_forward",
    plugin: Any = None,
    checkpoint_mode: str = "full",
    target: str = "cpu",
    fake_batch: bool = False,
    warmup: str = "step",
    step: StepSpec | None = None,
) -> MemoryEstimate:
    """Predict the per-phase device peak of a steady-state training step; see the module doc.

    Args:
        model_factory: builds the model; called under fake mode (a 120B-parameter config costs no memory).
        batch_factory: builds one batch on the device (``torch.randint``, ``torch.randn``...): real tensors, made
            outside the fake mode (their values are read), unless ``fake_batch``.
        loss_fn: ``(model, batch) -> scalar loss``; default :func:`default_loss` (``model(**batch).loss`` and kin).
        optimizer: ``"adamw"`` (``AdamW(lr=1e-3)``), ``"sgd"`` (``SGD(lr=1e-3, momentum=0.9)``) or an
            optimizer class (``optimizer_kwargs`` override its arguments), all over the trainable parameters;
            or a callable ``model -> Optimizer`` (a LightningModule's ``configure_optimizers``).
        precision: Lightning's name: ``"32-true"``, ``"bf16-true"``, ``"16-true"`` (model, gradients and optimizer
            state in that dtype, forward under it as default dtype) or ``"bf16-mixed"`` (autocast).
        checkpoint: recompute in backward: ``"auto"`` (the model's repeated blocks) or a policy as for
            :func:`~lightning_memkit.memory.select_modules`; ``None``: nothing recomputed.
        patches: callables ``model -> context manager`` entered around both steps (e.g. a fused loss).
        expert_balance: how MoE expert modules route tokens; only ``"uniform"``.
        zero_grad: when the previous step's gradients are dropped (``zero_grad(set_to_none=True)``):
            ``"after_forward"`` (Lightning's automatic optimization: they are alive during the forward) or
            ``"before_forward"`` (the usual plain PyTorch loop); ``"accumulate"``: a micro-step of gradient
            accumulation after the first (Lightning's ``accumulate_grad_batches > 1``): the gradients are alive
            through forward and backward, which adds into them.
        plugin: a Lightning precision plugin (e.g. :class:`~lightning_memkit.plugins.NoSaveBitsandbytesPrecision`
            for QLoRA): its ``convert_module`` converts the model after it is built, its ``forward_context`` and
            ``convert_input`` wrap the forward, as in a ``Trainer``; ``precision`` must then stay ``"32-true"``.
        checkpoint_mode: ``"full"`` (recompute whole blocks) or ``"selective"`` (keep matmul/attention outputs),
            as :func:`~lightning_memkit.memory.checkpoint_modules`.
        target: the device the step will run on. ``"cpu"``: the step as it runs here (``LivePeak``'s count).
            ``"cuda"``: plus what CUDA kernels allocate that the CPU path does not, from documented formulas:
            ``optimizer.step()``'s ``foreach`` temporaries (torch's default on CUDA; AdamW: one buffer the size
            of all trainable parameters, :func:`~lightning_memkit.pipeline.cost.optimizer_step_bytes`) in place
            of the per-parameter ones.
        fake_batch: ``batch_factory`` runs under the fake mode too: the batch takes no memory and has no values
            (right for token ids a model only embeds; a model that reads its batch, e.g. to check labels,
            needs the default: a real batch, made outside the fake mode).
        warmup: ``"step"``: the first step runs for real; ``"synthetic"``: its state (gradients, optimizer state) is
            made directly (about half the work) and checked by the recorded step, which is traced again after a
            real first step where the check fails (:func:`trace_steady_step`): the same bytes either way.
        step: the whole step as one :class:`~lightning_memkit.estimate.step_spec.StepSpec` (a plan's, with its
            levers' patches, transforms and optimizer wrappers), in place of ``precision``, ``checkpoint``,
            ``checkpoint_mode``, ``patches``, ``zero_grad``, ``plugin`` and ``target`` (left at their defaults).

    Raises:
        TypeError / ValueError: a bad argument, named, before anything is built.
    """
    if step is None:
        check_choice(checkpoint_mode, "checkpoint_mode", CHECKPOINT_MODES, owner=_OWNER)
        step = StepSpec(precision=precision, plugin=None if plugin is None else (lambda: plugin),
                        recompute=checkpoint_mode if checkpoint is not None else None, policy=checkpoint,
                        patches=list(patches), zero_grad=zero_grad, target=target)
    elif (precision, checkpoint, tuple(patches), zero_grad, plugin, checkpoint_mode, target) != _step_defaults():
        raise ValueError(f"{_OWNER}: pass the step's settings in step= or as keywords, not both")
    else:
        plugin = step.make_plugin()
    policy = step.policy if step.recompute else None
    _check_args(model_factory, batch_factory, loss_fn, step.precision, policy, step.patches, expert_balance)
    check_choice(step.zero_grad, "zero_grad", ZERO_GRAD, owner=_OWNER)
    check_choice(step.recompute or "full", "checkpoint_mode", CHECKPOINT_MODES, owner=_OWNER)
    check_choice(step.target, "target", TARGETS, owner=_OWNER)
    check_bool(fake_batch, "fake_batch", owner=_OWNER)
    check_choice(warmup, "warmup", WARMUPS, owner=_OWNER)
    _check_plugin(plugin, step.precision)
    make_optimizer, opt_name = resolve_optimizer(optimizer, optimizer_kwargs)
    make_optimizer, opt_name = step.wrap_optimizer(make_optimizer, opt_name)
    start = time.perf_counter()
    tracing = trace_steady_step if warmup == "synthetic" else trace_training_step
    trace = tracing(model_factory, batch_factory, make_optimizer, step, loss_fn=loss_fn, fake_batch=fake_batch,
                    plugin=plugin)
    return trace.estimate(opt_name, time.perf_counter() - start)


def _step_defaults() -> tuple[Any, ...]:
    """The defaults of the keywords ``step=`` stands for, as :func:`estimate_training_memory` declares them."""
    params = inspect.signature(estimate_training_memory).parameters
    return tuple(params[k].default for k in _STEP_KEYWORDS)


_STEP_KEYWORDS = ("precision", "checkpoint", "patches", "zero_grad", "plugin", "checkpoint_mode", "target")


@dataclass
class StepTrace:
    """What one run of :func:`trace_training_step` saw: the phases, the counts, the features; and, when asked for,
    the :class:`~lightning_memkit.estimate.trace.EventLog` of every allocation, the decoder layers' names and the
    bytes ``optimizer.step()``'s ``foreach`` implementation adds on CUDA (``target="cuda"``)."""

    phases: list[PhaseEstimate]
    parameters: int
    trainable_parameters: int
    precision: str
    features: list[str]
    flops: int
    allocated: int
    target: str
    foreach_bytes: int = 0
    log: EventLog | None = None
    layers: list[str] = field(default_factory=list)
    host_bytes: int = 0  # the recorded step's host peak (offloaded bytes)
    optimizer_bytes: int = 0  # of allocated, the bytes optimizer.step() created
    host_steady: int = 0  # host bytes alive when the recorded step starts
    parameter_bytes: int = 0  # the parameters' bytes as this rank holds them
    largest: Any = None  # the recorded phases' largest storages (trace.Largest)

    def estimate(self, optimizer: str, seconds: float) -> MemoryEstimate:
        return MemoryEstimate(phases=self.phases, peak_bytes=max(p.peak_bytes for p in self.phases[1:]),
                              parameters=self.parameters, trainable_parameters=self.trainable_parameters,
                              optimizer=optimizer, precision=self.precision, features=self.features,
                              assumptions=_assumptions(any("MoE" in f for f in self.features), self.target,
                                                       any(f.startswith("DDP gradient") for f in self.features)),
                              seconds=seconds, step_flops=self.flops, step_bytes=self.allocated,
                              host_bytes=self.host_bytes, optimizer_step_bytes=self.optimizer_bytes,
                              host_steady_bytes=self.host_steady, parameter_bytes=self.parameter_bytes,
                              largest_tensor={} if self.largest is None else {
                                  "bytes": self.largest.nbytes, "shape": list(self.largest.shape),
                                  "module": self.largest.module})


class WarmupMismatch(RuntimeError):
    """A synthetic warm-up (``warmup="synthetic"``) did not leave the state a first step leaves."""


WARMUPS = ("step", "synthetic")


def trace_training_step(model_factory: Callable[[], nn.Module], batch_factory: Callable[[], Any],
                        make_optimizer: Callable[[nn.Module], Any], step: StepSpec | None = None, *,
                        loss_fn: Any = None,
                        fake_batch: bool = False, log: bool = False, warmup: str = "step",
                        plugin: Any = None) -> StepTrace:
    """The two steps of :func:`estimate_training_memory` (its arguments already checked; ``make_optimizer`` already
    wrapped by the step's levers), as ``step`` says: its precision, plugin (``plugin``: one made already, else the
    step's own), recomputation, patches, model transforms, ``zero_grad`` and target (``None``: a plain step).
    ``log``: keep an :class:`~lightning_memkit.estimate.trace.EventLog` of every allocation of the recorded phases,
    filed by decoder layer, for :mod:`~lightning_memkit.estimate.compose`.

    ``warmup``: ``"step"`` runs the first step for real; ``"synthetic"`` (half the work) leaves what it would
    leave directly: a gradient for every trainable parameter (the same bytes autograd makes) and the optimizer's
    state, allocated by one ``optimizer.step()`` on them. The recorded step then checks that it is a steady
    state: its backward leaves gradients for exactly those parameters, of those sizes, and no storage other than
    gradients survives it that was not alive before it (state a first forward creates and keeps); else
    :class:`WarmupMismatch` is raised (trace again with ``warmup="step"``)."""
    check_choice(warmup, "warmup", WARMUPS, owner="trace_training_step")
    step = step or StepSpec()
    plugin = step.make_plugin() if plugin is None else plugin
    precision, zero_grad, target = step.precision, step.zero_grad, step.target
    with (_world(step), fake_tensors() as gaps, CategoryTracker() as tracker, FastOps() as fast,
          contextlib.ExitStack() as stack):
        events = tracker.log = EventLog({}) if log else None
        model = _load(model_factory, step, plugin, tracker, events)
        buckets = _replica_buckets(model, step)
        tracker.move(buckets, "gradients")
        clock = _module_clock(model, tracker)
        grads = _record_gradients(model, stack)  # before the optimizer's own hooks (a step in backward frees them)
        optim = _checked_optimizer(make_optimizer, model)
        run = _Run(model, optim, tracker, batch_factory, loss_fn or default_loss,
                   precision, zero_grad, gaps, plugin, fake_batch, grads=grads)
        blocks = layer_blocks(model) if log else []
        if events is not None:
            _log_layers(run, events, blocks)
        features = _install_features(run, clock, step, stack, buckets)
        warmed = _warm_up(run, warmup)
        before, steady = _recorded_step(run, fast, events, blocks)
        if warmup == "synthetic":
            _check_steady_state(tracker, before, warmed, run.grads)
        phases, foreach = _phase_estimates(tracker, optim, target)
        counts = _parameter_counts(model, optim)
        layers = [name for name, _ in blocks]
        host = max(tracker.host_peaks.get(name, 0) for name in STEP_PHASES)
        _drop_feature_widths(tracker, model)
        label = _precision_label(precision, plugin, model)
        del run, model, optim, blocks, buckets
    return StepTrace(phases, counts[0], counts[1], label, features,
                     fast.flops, tracker.allocated, target, foreach, events, layers, host,
                     tracker.allocated_by_phase.get("optimizer step", 0), steady, counts[2], tracker.largest)


def _load(model_factory: Callable[[], nn.Module], step: StepSpec, plugin: Any, tracker: CategoryTracker,
          events: EventLog | None) -> nn.Module:
    """The load phase (the model built as ``step`` says), then ``step``'s transforms on the model."""
    tracker.start_phase("load", "weights")
    model = _build_logged(model_factory, step.precision, plugin, tracker)
    tracker.start_phase(None, "transient")
    for transform in step.transforms:  # after the load phase: the model as built, then (say) sharded
        model = transform(model)
    if step.transforms and events is not None:  # the layers' tensors now are the transformed ones
        _file_layers(tracker, model, {})
    return model


def _module_clock(model: nn.Module, tracker: CategoryTracker) -> ModuleClock:
    """A :class:`~lightning_memkit.estimate.trace.ModuleClock` over ``model``'s modules, the tracker's clock."""
    names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
    clock = ModuleClock(names)
    tracker.clock = clock
    return clock


def _checked_optimizer(make_optimizer: Callable[[nn.Module], Any], model: nn.Module) -> torch.optim.Optimizer:
    """``make_optimizer(model)``, refused unless it is a ``torch.optim.Optimizer``."""
    optim = make_optimizer(model)
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError(f"{_OWNER}(optimizer=...) must make a torch.optim.Optimizer, got {type(optim).__name__}")
    return optim


def _log_layers(run: _Run, events: EventLog, blocks: list[tuple[str, nn.Module]]) -> None:
    """File every module of the decoder layers ``blocks`` by its layer, and have their tensors claimed before the
    recorded optimizer step."""
    events.layer_of.update({f"{name}.{sub}" if sub else name: j for j, (name, block) in enumerate(blocks)
                            for sub, _ in block.named_modules()})
    run.before_step = lambda b=blocks, o=run.optimizer: _claim_layers(events, b, o)


def _install_features(run: _Run, clock: ModuleClock, step: StepSpec, stack: contextlib.ExitStack,
                      buckets: list[torch.Tensor]) -> list[str]:
    """Hooks, recomputation and ``step``'s patches on the model, undone by ``stack``; returns the features' names."""
    head, tail = _install(run, clock, step.checkpoint, stack)
    features = [*head, *_patch(run.model, step.patches, stack), *tail]
    if buckets:
        features.append(f"DDP gradient buckets ({step.world.replicate} replicas)")
    return features


def _warm_up(run: _Run, warmup: str) -> dict[str, tuple[int, torch.dtype]] | None:
    """The first step, as ``warmup`` says, then for ``zero_grad="accumulate"`` the previous micro-step's gradients;
    returns the synthetic warm-up's gradients (:func:`_synthetic_warmup`), ``None`` after a real step."""
    warmed = None
    if warmup == "synthetic":
        warmed = _synthetic_warmup(run)
    else:
        _step(run, record=False)
    if run.zero_grad == "accumulate":
        _previous_micro_step(run, warmed if warmup == "synthetic" else run.grads)
    return warmed


def _live_storages(tracker: CategoryTracker) -> set[int]:
    """The keys of the storages the tracker holds alive, gradients excepted."""
    return {k for k, e in tracker._entries.items() if e.tag[0] != "gradients"}


def _recorded_step(run: _Run, fast: FastOps, events: EventLog | None,
                   blocks: list[tuple[str, nn.Module]]) -> tuple[set[int], int]:
    """The recorded step, its FLOPs counted, from the tracker's counts zeroed; returns the storages alive before it
    (:func:`_live_storages`) and the host bytes alive then."""
    tracker = run.tracker
    _classify_static(run)
    before = _live_storages(tracker)
    tracker.allocated, tracker.allocated_by_phase = 0, {}
    steady = tracker.host_live_bytes
    if events is not None:  # the layers' tensors are theirs from the start: a step in backward reads them there
        _claim_layers(events, blocks, run.optimizer)
    fast.counting = True
    _step(run, record=True)
    fast.counting = False
    return before, steady


def _check_steady_state(tracker: CategoryTracker, before: set[int], warmed: dict[str, tuple[int, torch.dtype]],
                        grads: dict[str, tuple[int, torch.dtype]]) -> None:
    """Raise :class:`WarmupMismatch` unless the recorded step left the gradients of the synthetic warm-up
    (``warmed``) and no new storage other than gradients."""
    kept = _live_storages(tracker) - before
    if warmed != grads or kept:
        same = "differ" if warmed != grads else "match"
        raise WarmupMismatch(f"{_OWNER}: the recorded step after a synthetic warm-up is not a steady state "
                             f"({len(kept)} new storages kept, gradients {same})")


def _phase_estimates(tracker: CategoryTracker, optim: torch.optim.Optimizer,
                     target: str) -> tuple[list[PhaseEstimate], int]:
    """The load phase and the step's phases, the optimizer step's with the bytes its ``foreach`` implementation adds
    on CUDA (``target="cuda"``); and those bytes."""
    phases = [PhaseEstimate.from_peak(name, tracker.phase_peaks[name]) for name in ("load", *STEP_PHASES)]
    foreach = _foreach_step_bytes(optim, tracker) if target == "cuda" else 0
    phases[-1].peak_bytes += foreach
    phases[-1].transient += foreach
    return phases, foreach


def _parameter_counts(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[int, int, int]:
    """The model's parameters, those the optimizer steps, and the bytes this rank holds of the parameters."""
    return (sum(p.numel() for p in model.parameters()),
            sum(p.numel() for g in optim.param_groups for p in g["params"]),
            sum(_local(p).nbytes for p in model.parameters()))


def _drop_feature_widths(tracker: CategoryTracker, model: nn.Module) -> None:
    """Forget the largest square storages whose side is a size of a parameter: a feature width, not a token count."""
    for side in {int(d) for p in model.parameters() for d in p.shape}:
        tracker.largest.squares.pop(side, None)


def trace_steady_step(model_factory: Callable[[], nn.Module], batch_factory: Callable[[], Any],
                      make_optimizer: Callable[[nn.Module], Any], step: StepSpec | None = None,
                      **kwargs: Any) -> StepTrace:
    """:func:`trace_training_step` after a synthetic warm-up (half the work), traced again after a real first step
    where the recorded step is not a steady state (:class:`WarmupMismatch`). ``model_factory`` may be called twice.
    A sharded step has a real first step at once: FSDP2 keeps the storages of its first all-gathers."""
    if step is not None and step.world.shard > 1:
        return trace_training_step(model_factory, batch_factory, make_optimizer, step, **kwargs)
    try:
        return trace_training_step(model_factory, batch_factory, make_optimizer, step, warmup="synthetic", **kwargs)
    except WarmupMismatch:
        return trace_training_step(model_factory, batch_factory, make_optimizer, step, **kwargs)


def _replica_buckets(model: nn.Module, step: StepSpec) -> list[torch.Tensor]:
    """A replica's DDP buckets (``step.world.replicate`` above 1, the parameters not sharded): DDP's reducer keeps one
    flat copy of every trainable parameter's gradient, per dtype, from its construction on (``gradient_as_bucket_view
    =False``, torch's and Lightning's default). Nothing for one replica or a sharded step."""
    if step.world.replicate == 1 or step.world.shard > 1:
        return []
    sizes: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.requires_grad:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return [torch.empty(n, dtype=dtype) for dtype, n in sizes.items()]


def _world(step: StepSpec) -> Any:
    """The ranks the step runs on, simulated in this process: a fake process group of ``step.world.shard`` ranks (this
    process rank 0) whose mesh the sharding transform reads, with FSDP2's resizes counted; nothing for one rank."""
    if step.world.shard == 1:
        return contextlib.nullcontext()
    from lightning_memkit.sharding import fake_mesh, visible_resizes

    stack = contextlib.ExitStack()
    stack.enter_context(fake_mesh(step.world.shard))
    stack.enter_context(visible_resizes())
    return stack


def _grad_record(p: torch.Tensor) -> tuple[int, torch.dtype]:
    """What the warm-up check compares of a parameter's gradient: its storage's bytes and its dtype."""
    return p.grad.untyped_storage().nbytes(), p.grad.dtype


def _record_gradients(model: nn.Module, stack: contextlib.ExitStack) -> dict[str, tuple[int, torch.dtype]]:
    """A dict that files each trainable parameter's gradient (:func:`_grad_record`) by name as its backward completes
    it: a post-accumulate-grad hook registered before any optimizer's, so an optimizer that steps in backward and
    frees the gradient (the step in backward, the host offload) cannot hide it. Removed when ``stack`` closes."""
    grads: dict[str, tuple[int, torch.dtype]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            def seen(t: torch.Tensor, name: str = name) -> None:
                grads[name] = _grad_record(t)

            stack.callback(p.register_post_accumulate_grad_hook(seen).remove)
    return grads


def _synthetic_warmup(run: _Run) -> dict[str, tuple[int, torch.dtype]]:
    """What a first step leaves, without running it: a gradient of zeros for each trainable parameter, and the
    optimizer's state from one step on them. Returns the gradients' bytes and dtypes by parameter name."""
    with torch.no_grad():
        for p in run.model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
    grads = {n: _grad_record(p) for n, p in run.model.named_parameters() if p.grad is not None}
    run.optimizer.step()  # (an optimizer may free the gradients: the host offload does)
    return grads


def _previous_micro_step(run: _Run, grads: dict[str, tuple[int, torch.dtype]]) -> None:
    """``zero_grad="accumulate"``: the recorded micro-step follows one whose backward left ``grads`` (by parameter
    name) and no optimizer step; give back, as zeros, those an optimizer freed at the warm-up's step (the host
    offload does)."""
    with torch.no_grad():
        for name, p in run.model.named_parameters():
            if name in grads and p.grad is None:
                p.grad = torch.zeros_like(p, dtype=grads[name][1], memory_format=torch.preserve_format)


def _precision_label(precision: str, plugin: Any, model: nn.Module) -> str:
    """The estimate's precision in words: the plugin's name, or ``precision`` with the weights' dtype where
    ``32-true`` trains weights loaded in another (a ``PretrainedCausalLM(dtype="bfloat16")``)."""
    if plugin is not None:
        return type(getattr(plugin, "converted_by", plugin)).__name__
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if precision == "32-true" and len(dtypes) == 1 and torch.float32 not in dtypes:
        return f"{precision} ({str(dtypes.pop()).removeprefix('torch.')} weights)"
    return precision


def _build_logged(model_factory: Callable[[], nn.Module], precision: str, plugin: Any,
                  tracker: CategoryTracker) -> nn.Module:
    """:func:`build_model`, filing in the tracker's :class:`~lightning_memkit.estimate.trace.EventLog` (if any) the
    allocations of the construction by the decoder layer whose parameters and buffers they made; the conversions
    that follow (dtype, plugin) by the layer owning their inputs."""
    if tracker.log is None:
        return build_model(model_factory, precision, plugin)
    serials: dict[int, int] = {}
    model = build_model(model_factory, precision, plugin, built=lambda m: _file_layers(tracker, m, serials))
    _file_layers(tracker, model, serials)
    rows = tracker.log.rows.get("load", [])
    layer = -1
    for i, row in enumerate(rows):  # an allocation that made no layer's tensor goes with the one before
        layer = serials.get(row[-2], row[0] if row[0] >= 0 else layer)
        rows[i] = (layer, *row[1:])
    return model


def _file_layers(tracker: CategoryTracker, model: nn.Module, serials: dict[int, int]) -> None:
    """Note which allocation made each parameter and buffer (``serials``: allocation number -> its decoder layer,
    ``-1`` for the others), and claim the layers' as theirs in the tracker's log."""
    layer_of = {id(t): j for j, (_, block) in enumerate(layer_blocks(model))
                for t in (*block.parameters(), *block.buffers())}
    for t in (*model.parameters(), *model.buffers()):
        j = layer_of.get(id(t), -1)
        if j >= 0:
            tracker.log.claim([t], j)
        entry = tracker._entries.get(storage_key(t)) if has_storage(t) else None
        if entry is not None:
            serials[entry.tag[1]] = j


def layer_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder layers of a transformers model (what ``ActivationCheckpointing`` wraps), else the model's
    repeated blocks (``repeated_blocks``)."""
    from lightning_memkit.hf.layers import decoder_layers

    return decoder_layers(model) or repeated_blocks(model)


def _claim_layers(events: EventLog, blocks: list[tuple[str, nn.Module]], optim: torch.optim.Optimizer) -> None:
    """Before the recorded optimizer step: each layer's parameters, gradients and optimizer state are its own."""
    for j, (_, block) in enumerate(blocks):
        params = list(block.parameters())
        events.claim([*params, *(p.grad for p in params if p.grad is not None)], j)
        events.claim(iter_tensors([optim.state[p] for p in params if p in optim.state]), j)
