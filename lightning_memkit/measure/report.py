"""Static memory of a model, per top-level child module, in bytes: what exists before a step runs.

:func:`static_memory_table` counts, for each direct child of a module (and the module's own
parameters, as ``(root)``):

- parameter bytes by real storage: a bitsandbytes ``Params4bit``/``Int8Params`` (or the QLoRA plugin's packed
  weight) counts its packed bytes plus its quantization state (``absmax``, ``code``, nested state, ``SCB``; the
  plugin's layers hold it as byte parameters and buffers of their own, counted with the weight); buffers apart;
- gradient bytes of the trainable parameters: the ``.grad`` already allocated, else what it will be
  (same numel and dtype as the parameter: "expected");
- optimizer state bytes: the optimizer's ``state`` where it exists ("allocated"), else what the
  optimizer will create at its first step (Adam/AdamW: ``exp_avg``, ``exp_avg_sq`` and ``step``; SGD
  with momentum: one buffer; see :func:`~lightning_memkit.pipeline.optimizer_state_bytes`: "expected");
- trainable and frozen parameter elements (logical elements: a 4-bit weight of shape ``(32, 64)`` counts
  2048) and the parameter dtypes.

A parameter or buffer shared by several children (tied embeddings) is counted once, in the first child
that holds it, so the total row is the sum of the rows.

Example::

    >>> import torch
    >>> from lightning_memkit.measure.report import static_memory_table
    >>> model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2))
    >>> model[1].requires_grad_(False)  # doctest: +ELLIPSIS
    Linear(...)
    >>> table = static_memory_table(model, torch.optim.AdamW(model[0].parameters()))
    >>> [(r.name, r.param_bytes, r.grad_bytes, r.optimizer_bytes) for r in table.rows]
    [('0', 440, 440, 888), ('1', 88, 0, 0)]
    >>> table.total.param_bytes, table.optimizer_source
    (528, 'expected')
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_memkit.measure.storage import format_bytes, storage_key, storage_of, tensors_in, unique_storage_bytes

__all__ = [
    "MemoryRow", "StaticMemoryTable", "static_memory_table", "render_text", "parameter_storage_bytes", "logical_numel",
]


@dataclass
class MemoryRow:
    """Bytes and element counts of one child module (or of the total)."""

    name: str
    kind: str
    param_bytes: int = 0
    buffer_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int | None = 0  # None: an optimizer without state whose state size is unknown
    trainable: int = 0
    frozen: int = 0
    dtypes: list[str] = field(default_factory=list)

    def add(self, other: MemoryRow) -> None:
        """Add ``other``'s bytes and counts to this row (``None`` optimizer bytes stay unknown)."""
        self.param_bytes += other.param_bytes
        self.buffer_bytes += other.buffer_bytes
        self.grad_bytes += other.grad_bytes
        unknown = self.optimizer_bytes is None or other.optimizer_bytes is None
        self.optimizer_bytes = None if unknown else self.optimizer_bytes + other.optimizer_bytes
        self.trainable += other.trainable
        self.frozen += other.frozen
        self.dtypes = sorted(set(self.dtypes) | set(other.dtypes))

    @property
    def total_bytes(self) -> int | None:
        """Parameters, buffers, gradients and optimizer state together (``None`` if the state is unknown)."""
        if self.optimizer_bytes is None:
            return None
        return self.param_bytes + self.buffer_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass
class StaticMemoryTable:
    """The rows of :func:`static_memory_table` and where the gradient and optimizer figures come from.

    ``grad_source`` / ``optimizer_source``: ``"allocated"`` (read from existing tensors), ``"expected"``
    (computed from the parameters), ``"allocated+expected"`` (some of each) or ``"none"`` (nothing to
    count: no trainable parameter, no optimizer).
    """

    rows: list[MemoryRow]
    total: MemoryRow
    grad_source: str
    optimizer_source: str
    optimizer_names: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def table(self, title: str = "Static memory per module (bytes)"):
        """A ``rich.table.Table``: one row per child module and a total row (exact bytes)."""
        from rich.table import Table

        optimizers = f" ({', '.join(self.optimizer_names)})" if self.optimizer_names else ""
        caption = [f"grads: {self.grad_source}; optimizer state: {self.optimizer_source}{optimizers}", *self.notes]
        table = Table(title=title, title_justify="left", caption="\n".join(caption), caption_justify="left")
        table.add_column("module", overflow="fold")
        columns = ["params", *(["buffers"] if self.total.buffer_bytes else []), "grads", "optimizer", "trainable",
                   "frozen"]
        for header in columns:
            table.add_column(header, justify="right", no_wrap=True)
        table.add_column("dtypes", overflow="fold")
        for i, row in enumerate([*self.rows, self.total]):
            values = {"params": row.param_bytes, "buffers": row.buffer_bytes, "grads": row.grad_bytes,
                      "optimizer": row.optimizer_bytes, "trainable": row.trainable, "frozen": row.frozen}
            cells = ["n/a" if values[c] is None else f"{values[c]:,}" for c in columns]
            table.add_row(f"{row.name} ({row.kind})", *cells, ", ".join(row.dtypes),
                          end_section=i == len(self.rows) - 1)
        return table

    def __str__(self) -> str:
        return render_text(self.table(), width=160)

    def summary(self) -> str:
        """One line: the total in bytes and its parts."""
        t = self.total
        optimizer = "unknown" if t.optimizer_bytes is None else format_bytes(t.optimizer_bytes)
        return (f"static memory {format_bytes(t.total_bytes)}: parameters {format_bytes(t.param_bytes)}, buffers "
                f"{format_bytes(t.buffer_bytes)}, gradients {format_bytes(t.grad_bytes)} ({self.grad_source}), "
                f"optimizer state {optimizer} ({self.optimizer_source})")


def render_text(renderable: Any, width: int = 120) -> str:
    """``renderable`` (a ``rich`` table, say) as plain text ``width`` columns wide, printed nowhere."""
    import io

    from rich.console import Console

    console = Console(width=width, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


# -- per-parameter accounting -----------------------------------------------------------------------------
def _quant_tensors(p: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of a bitsandbytes parameter's quantization state (none for a plain tensor)."""
    holders = [getattr(p, "quant_state", None), getattr(p, "SCB", None)]
    return list(tensors_in([h for h in holders if h is not None], max_depth=8))  # nested state: 6 levels


def _quant_storages(params: Iterable[torch.Tensor]) -> set[int]:
    """Storage keys of the quantization state of the quantized weights among ``params``."""
    return {storage_key(s) for p in params for t in _quant_tensors(p) if (s := storage_of(t)) is not None}


def _is_quant_state(t: torch.Tensor, quant: set[int]) -> bool:
    """Whether ``t`` holds (part of) a quantized weight's quantization state, counted with that weight: the plugin's
    layers keep it as byte parameters and buffers of their own (FSDP2 shards them with the weight)."""
    s = storage_of(t)
    return s is not None and storage_key(s) in quant and not _quant_tensors(t)


def parameter_storage_bytes(p: torch.Tensor) -> int:
    """Bytes ``p`` really occupies: its own elements plus, for bitsandbytes weights, the quantization state.

    A meta tensor counts the bytes it will have once materialized.
    """
    own = p.numel() * p.element_size()
    skip = [storage_key(p)] if storage_of(p) is not None else []
    return own + unique_storage_bytes(_quant_tensors(p), skip=skip)


def logical_numel(p: torch.Tensor) -> int:
    """Elements of the weight ``p`` stands for: the unpacked shape of a 4-bit weight, else ``p.numel()``."""
    qs = getattr(p, "quant_state", None)
    shape = getattr(qs, "shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else p.numel()


def _dtype_name(p: torch.Tensor) -> str:
    qs = getattr(p, "quant_state", None)
    if qs is not None and getattr(qs, "quant_type", None):
        return f"{qs.quant_type} (packed {str(p.dtype).removeprefix('torch.')})"
    if getattr(p, "SCB", None) is not None:
        return "int8 (row-wise)"
    return str(p.dtype).removeprefix("torch.")


# -- optimizers ---------------------------------------------------------------------------------------------
def _optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    items = list(optimizer) if isinstance(optimizer, Sequence) and not isinstance(optimizer, str) else [optimizer]
    out = []
    for opt in items:
        opt = getattr(opt, "_optimizer", opt)  # Lightning's LightningOptimizer wrapper
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                "static_memory_table(optimizer=...) must be None, a torch.optim.Optimizer or a sequence of them, "
                f"got {type(opt).__name__}"
            )
        out.append(opt)
    return out


class _OptimizerBytes:
    """Optimizer state bytes per parameter, allocated where the state exists, else expected."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        self.groups = [{id(p) for g in opt.param_groups for p in g["params"]} for opt in optimizers]
        self.sources: set[str] = set()
        self.unknown: set[str] = set()

    def of(self, p: torch.Tensor) -> int | None:
        total: int | None = 0
        for opt, members in zip(self.optimizers, self.groups):
            if id(p) not in members:
                continue
            state = opt.state.get(p)
            if state:
                self.sources.add("allocated")
                total = None if total is None else total + sum(
                    t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
                continue
            expected = self._expected(opt, p)
            total = None if total is None or expected is None else total + expected
        return total

    def _expected(self, opt: torch.optim.Optimizer, p: torch.Tensor) -> int | None:
        from lightning_memkit.pipeline.cost import optimizer_state_bytes

        if not p.requires_grad:
            return 0
        try:
            n = optimizer_state_bytes([p], opt)
        except ValueError:  # an optimizer whose state size is not known (8-bit Adam, Adafactor, ...)
            self.unknown.add(type(opt).__name__)
            return None
        self.sources.add("expected")
        return n


def _source(sources: set[str]) -> str:
    return "+".join(s for s in ("allocated", "expected") if s in sources) or "none"


# -- the table ----------------------------------------------------------------------------------------------
def _children(module: nn.Module) -> list[tuple[str, str, list[nn.Parameter], list[torch.Tensor]]]:
    """``(name, kind, parameters, buffers)`` per direct child, then ``(root)`` for the module's own tensors."""
    out = [(name, type(child).__name__, list(child.parameters()), list(child.buffers()))
           for name, child in module.named_children()]
    own_params = list(module.parameters(recurse=False))
    own_buffers = list(module.buffers(recurse=False))
    if own_params or own_buffers:
        out.append(("(root)", type(module).__name__, own_params, own_buffers))
    return out


def _row(name: str, kind: str, params: Iterable[torch.Tensor], buffers: Iterable[torch.Tensor], seen: set[int],
         optimizer: _OptimizerBytes, grad_sources: set[str]) -> MemoryRow:
    row = MemoryRow(name, kind)
    dtypes = set()
    params, buffers = list(params), list(buffers)
    quant = _quant_storages(params)
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if _is_quant_state(p, quant):
            continue
        row.param_bytes += parameter_storage_bytes(p)
        dtypes.add(_dtype_name(p))
        if p.requires_grad:
            row.trainable += logical_numel(p)
            grad = p.grad
            grad_sources.add("expected" if grad is None else "allocated")
            row.grad_bytes += (p if grad is None else grad).numel() * (p if grad is None else grad).element_size()
        else:
            row.frozen += logical_numel(p)
        state = optimizer.of(p)
        row.optimizer_bytes = None if state is None or row.optimizer_bytes is None else row.optimizer_bytes + state
    for b in buffers:
        if id(b) not in seen:
            seen.add(id(b))
            if not _is_quant_state(b, quant):
                row.buffer_bytes += b.numel() * b.element_size()
    row.dtypes = sorted(dtypes)
    return row


def static_memory_table(module: nn.Module, optimizer: Any = None) -> StaticMemoryTable:
    """Parameter, buffer, gradient and optimizer-state bytes of ``module`` per top-level child.

    Args:
        module: the model (a LightningModule or any ``nn.Module``).
        optimizer: ``None`` (no optimizer state counted), an optimizer, or a sequence of them
            (``trainer.optimizers``; Lightning's ``LightningOptimizer`` wrappers are accepted).

    A parameter in none of the optimizers' groups has no state. An optimizer that has not stepped yet
    counts what it will create; one whose state size is not known gives ``None`` ("n/a") for the rows
    it touches, with a note naming it.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"static_memory_table(module=...) must be a torch.nn.Module, got {type(module).__name__}")
    opt = _OptimizerBytes(_optimizers(optimizer))
    seen: set[int] = set()
    grad_sources: set[str] = set()
    rows = [_row(name, kind, params, buffers, seen, opt, grad_sources)
            for name, kind, params, buffers in _children(module)]
    total = MemoryRow("total", type(module).__name__)
    for row in rows:
        total.add(row)
    notes = []
    if opt.unknown:
        notes.append(f"optimizer state size unknown for {', '.join(sorted(opt.unknown))} before its first step (n/a)")
    if not opt.optimizers:
        notes.append("no optimizer: optimizer state not counted")
    return StaticMemoryTable(rows, total, _source(grad_sources), _source(opt.sources),
                             [type(o).__name__ for o in opt.optimizers], notes)


def feature_owners(trainer: Any) -> list[Any]:
    """The memkit objects of ``trainer`` that report a memory effect: callbacks, precision plugin, strategy."""
    candidates = [*getattr(trainer, "callbacks", []), getattr(trainer, "precision_plugin", None),
                  getattr(trainer, "strategy", None)]
    return [obj for obj in candidates
            if obj is not None and type(obj).__module__.startswith("lightning_memkit.")
            and callable(getattr(obj, "memory_effect", None))]


def memory_effects(trainer: Any) -> list[str]:
    """One line per active memkit feature of ``trainer``: what it measurably did to memory, in bytes."""
    return [owner.memory_effect() for owner in feature_owners(trainer)]


def report_console() -> Any:
    """A ``rich`` console for reports: the terminal's width, or 120 columns in a log file or a pipe."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=120)

