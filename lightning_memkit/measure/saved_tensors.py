"""Which module keeps which bytes alive for backward: the saved-tensor profile of one forward.

Autograd keeps tensors alive between forward and backward in two ways: ``ctx.save_for_backward`` (and
the built-in ops' saved variables), which ``torch.autograd.graph.saved_tensors_hooks`` can see, and
attributes that an autograd ``Function`` stashes on ``ctx`` (or a module keeps as a cache), which no
hook sees. :class:`SavedTensorRecorder` catches both: a pack hook records every saved storage, and a
:class:`~lightning_memkit.memory.LivePeak` tagged with the innermost running module finds the storages
created during forward that are still alive afterwards although nothing saved them. Each storage is
counted once, for the module whose forward was running when it was saved (or created, for stashes),
as ``weight`` when it is a parameter's or buffer's storage and as ``activation`` otherwise.

Example::

    >>> import torch
    >>> from lightning_memkit.memory import profile_saved_tensors
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> report = profile_saved_tensors(mlp, torch.randn(8, 16))
    >>> [(r.name, r.activation_bytes) for r in report.rows]
    [('0', 512), ('1', 1024), ('2', 0)]
    >>> report.new_activation_bytes  # comparable with LivePeak.live_bytes around forward (output excluded)
    1024
"""

from __future__ import annotations

import json
import logging
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_memkit.measure.live_peak import LivePeak
from lightning_memkit.measure.storage import format_bytes, iter_tensors, storage_key, storage_of, tensors_in

__all__ = ["SavedTensorRecorder", "SavedTensorReport", "SavedTensorRow", "SavedStorage", "profile_saved_tensors"]

log = logging.getLogger(__name__)

ROOT_LABEL = "(root)"
_QUANT_ATTRS = ("quant_state", "CB", "SCB")  # tensors that quantized parameters (bitsandbytes) carry beside .data


@dataclass
class SavedTensorRow:
    """Bytes kept for backward by one module (or one group of modules at the report's ``depth``).

    ``activation_bytes`` includes ``stashed_bytes`` (the part found only by the live-storage scan).
    ``num_tensors`` counts saved tensors (a storage saved twice counts twice, its bytes once) plus stashes.
    """

    name: str
    num_tensors: int = 0
    activation_bytes: int = 0
    weight_bytes: int = 0
    stashed_bytes: int = 0

    @property
    def label(self) -> str:
        return self.name or ROOT_LABEL

    @property
    def total_bytes(self) -> int:
        return self.activation_bytes + self.weight_bytes


@dataclass
class SavedStorage:
    """One counted storage: who kept it, how big, and why it is counted."""

    name: str
    nbytes: int
    device: str
    kind: str  # "activation" or "weight"
    stashed: bool = False  # retained without passing through a pack hook (ctx attribute, module cache)
    preexisting: bool = False  # existed before the forward (the input, for instance)
    output: bool = False  # also held by the forward's output


@dataclass
class SavedTensorReport:
    """Result of :func:`profile_saved_tensors` (or :meth:`SavedTensorRecorder.report`); all sizes in bytes.

    ``new_activation_bytes`` (activation total minus ``output_bytes`` minus ``preexisting_bytes``) is the
    quantity that ``LivePeak.live_bytes`` measured around the same forward (output storages excluded)
    reports. ``peak_bytes`` is the LivePeak high-water mark over forward and backward, ``None`` when no
    backward was measured.
    """

    rows: list[SavedTensorRow]
    total_activation_bytes: int
    total_weight_bytes: int
    stashed_bytes: int
    preexisting_bytes: int
    output_bytes: int
    forward_peak_bytes: int
    peak_bytes: int | None = None
    depth: int | None = None
    storages: list[SavedStorage] = field(default_factory=list, repr=False)

    @property
    def new_activation_bytes(self) -> int:
        return self.total_activation_bytes - self.output_bytes - self.preexisting_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict with exact byte counts (rows and the individual storages included)."""
        return {
            "depth": self.depth,
            "total_activation_bytes": self.total_activation_bytes,
            "total_weight_bytes": self.total_weight_bytes,
            "stashed_bytes": self.stashed_bytes,
            "preexisting_bytes": self.preexisting_bytes,
            "output_bytes": self.output_bytes,
            "new_activation_bytes": self.new_activation_bytes,
            "forward_peak_bytes": self.forward_peak_bytes,
            "peak_bytes": self.peak_bytes,
            "rows": [asdict(r) for r in self.rows],
            "storages": [asdict(s) for s in self.storages],
        }

    def save_json(self, path: str | Path, **extra: Any) -> Path:
        """Write :meth:`to_dict` (plus ``extra`` keys) to ``path``; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**extra, **self.to_dict()}, indent=2))
        return path

    def top_rows(self, max_rows: int | None = None) -> list[SavedTensorRow]:
        """The ``max_rows`` largest rows (activation + weight bytes), kept in model order."""
        if max_rows is None or len(self.rows) <= max_rows:
            return list(self.rows)
        keep = sorted(range(len(self.rows)), key=lambda i: -self.rows[i].total_bytes)[:max_rows]
        return [self.rows[i] for i in sorted(keep)]

    def table(self, max_rows: int | None = None, title: str | None = "Saved tensors per module"):
        """A :class:`rich.table.Table` of the rows (the ``max_rows`` largest) and the totals."""
        from rich.table import Table

        table = Table(title=title)
        table.add_column("module")
        for col in ("tensors", "activation", "stashed", "weight"):
            table.add_column(col, justify="right")
        shown = self.top_rows(max_rows)
        for r in shown:
            table.add_row(
                r.label, str(r.num_tensors), format_bytes(r.activation_bytes), format_bytes(r.stashed_bytes),
                format_bytes(r.weight_bytes),
            )
        if len(shown) < len(self.rows):
            table.add_row(f"... {len(self.rows) - len(shown)} smaller rows", "", "", "", "")
        table.add_section()
        table.add_row(
            "total", str(sum(r.num_tensors for r in self.rows)), format_bytes(self.total_activation_bytes),
            format_bytes(self.stashed_bytes), format_bytes(self.total_weight_bytes), style="bold",
        )
        table.add_section()
        for label, value in self._figures():
            table.add_row(label, "", format_bytes(value), "", "", style="dim")
        return table

    def plot(self, path: str | Path, max_rows: int | None = 30, title: str = "Saved tensors per module") -> Path:
        """Write a stacked horizontal bar chart (saved activation, stashed activation, weight) to ``path``."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        rows = self.top_rows(max_rows)
        labels = [r.label for r in rows]
        largest = max([r.total_bytes for r in rows], default=0)
        power = next((p for p in (3, 2, 1) if largest >= 1024**p), 0)
        unit, scale = ("B", "KiB", "MiB", "GiB")[power], float(1024**power)
        saved = [(r.activation_bytes - r.stashed_bytes) / scale for r in rows]
        stashed = [r.stashed_bytes / scale for r in rows]
        weight = [r.weight_bytes / scale for r in rows]
        fig = Figure(figsize=(8, max(2.5, 0.3 * len(rows) + 1.2)))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ys = list(range(len(rows)))
        ax.barh(ys, saved, color="tab:blue", label="activation (saved)")
        ax.barh(ys, stashed, left=saved, color="tab:cyan", label="activation (stashed)")
        ax.barh(ys, weight, left=[a + b for a, b in zip(saved, stashed)], color="tab:orange", label="weight")
        ax.set_yticks(ys, labels)
        ax.invert_yaxis()
        ax.set_xlabel(f"{unit} kept for backward")
        ax.set_title(title)
        ax.legend(loc="best", fontsize="small")
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        return path

    def _figures(self) -> list[tuple[str, int]]:
        figures = [
            ("of which preexisting", self.preexisting_bytes),
            ("of which shared with output", self.output_bytes),
            ("new (LivePeak-comparable)", self.new_activation_bytes),
            ("forward peak", self.forward_peak_bytes),
        ]
        if self.peak_bytes is not None:
            figures.append(("forward+backward peak", self.peak_bytes))
        return figures

    def __str__(self) -> str:
        header = ("module", "tensors", "activation", "stashed", "weight")
        body = [
            (r.label, str(r.num_tensors), format_bytes(r.activation_bytes), format_bytes(r.stashed_bytes),
             format_bytes(r.weight_bytes))
            for r in self.rows
        ]
        total = ("total", str(sum(r.num_tensors for r in self.rows)), format_bytes(self.total_activation_bytes),
                 format_bytes(self.stashed_bytes), format_bytes(self.total_weight_bytes))
        widths = [max(len(line[i]) for line in [header, *body, total]) for i in range(len(header))]

        def fmt(line: tuple[str, ...]) -> str:
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))

        rule = "-" * len(fmt(header))
        figures = [f"{label}: {format_bytes(value)} ({value} bytes)" for label, value in self._figures()]
        return "\n".join([fmt(header), rule, *map(fmt, body), rule, fmt(total), *figures])


def weight_storage_keys(module: nn.Module) -> set[int]:
    """Storage keys of every parameter and buffer of ``module``, quantized parameters' side tensors included."""
    keys = set()
    for t in [*module.parameters(), *module.buffers()]:
        for tensor in [t, *(x for a in _QUANT_ATTRS for x in tensors_in(getattr(t, a, None), max_depth=3))]:
            if storage_of(tensor) is not None:
                keys.add(storage_key(tensor))
    return keys


@dataclass
class _Saved:
    name: str
    nbytes: int
    device: str
    kind: str
    preexisting: bool
    ref: weakref.ref = field(repr=False)
    savers: Counter = field(default_factory=Counter)


class SavedTensorRecorder:
    """Context manager that records what ``module``'s forwards keep alive for backward.

    Enter it, run the forward, call :meth:`stop` (hooks removed, what is alive now is snapshotted),
    optionally run backward (the LivePeak keeps counting until exit), then call :meth:`report`.
    The module is held weakly; every hook is removed on :meth:`stop`/exit, exceptions included.

    ``torch.compile``: from entry to exit, compiled code runs eagerly (``torch.compiler.set_stance(
    "force_eager")``, put back at exit). A compiled graph hides which module an op belongs to, and its
    inductor buffers from the LivePeak, so the profile is the eager forward's, exact per module. Nothing
    is compiled or marked to skip meanwhile: after exit the compiled code runs again, without a recompile.

    Example::

        >>> import torch
        >>> from lightning_memkit.measure.saved_tensors import SavedTensorRecorder
        >>> net = torch.nn.Linear(4, 2)
        >>> with SavedTensorRecorder(net) as rec:
        ...     out = net(torch.randn(3, 4))
        ...     rec.stop()
        ...     out.sum().backward()
        >>> rec.report(output=out, include_peak=True).rows[0].activation_bytes   # the saved input
        48
    """

    def __init__(self, module: nn.Module, depth: int | None = None):
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        _check_depth(depth)
        self._module = weakref.ref(module)
        self.depth = depth
        self._stack: list[str] = []
        self._saved: dict[int, _Saved] = {}
        self._handles: list[Any] = []
        self._weight_keys: set[int] = set()
        self._order: dict[str, int] = {}
        self._hooks_ctx: torch.autograd.graph.saved_tensors_hooks | None = None
        self._stance: Any = None
        self.live_peak: LivePeak | None = None
        self._entered = False
        self._stopped = False
        self._exited = False
        self._counting = False
        self._snapshot: list[SavedStorage] | None = None
        self._snapshot_keys: list[int] = []
        self._saver_counts: Counter = Counter()
        self.forward_peak_bytes = 0

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> SavedTensorRecorder:
        if self._entered:
            raise RuntimeError("SavedTensorRecorder can be entered once: create a new one for another forward")
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "profile_saved_tensors needs grad mode: autograd saves nothing under torch.no_grad() or "
                "torch.inference_mode(); call it outside those blocks"
            )
        module = self._module()
        if module is None:
            raise RuntimeError("the module was garbage-collected before recording started")
        self._entered = True
        names = [name for name, _ in module.named_modules()]
        self._order = {name: i for i, name in enumerate(names)}
        self._weight_keys = weight_storage_keys(module)
        try:
            self._stance = torch.compiler.set_stance("force_eager")  # set now, put back by _exit_live_peak
            for name, sub in module.named_modules():
                self._handles.append(sub.register_forward_pre_hook(self._make_pre(name)))
                self._handles.append(sub.register_forward_hook(self._make_post(name), always_call=True))
            self.live_peak = LivePeak(tag=self._current)
            self.live_peak.__enter__()
            self._counting = True
            self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._hooks_ctx.__enter__()
        except BaseException:
            self._close_hooks()
            self._exit_live_peak(None, None, None)
            raise
        return self

    def stop(self) -> None:
        """End recording: remove the hooks and snapshot the storages alive now (call it with the output alive)."""
        if not self._entered or self._stopped:
            return
        self._stopped = True
        self._close_hooks()
        self.forward_peak_bytes = self.live_peak.peak_bytes
        storages, keys = [], []
        counts: Counter = Counter()
        for key, rec in self._saved.items():
            if rec.ref() is None:
                continue  # freed already: nothing keeps it for backward
            storages.append(SavedStorage(rec.name, rec.nbytes, rec.device, rec.kind, preexisting=rec.preexisting))
            keys.append(key)
            counts.update(rec.savers)
        saved_alive = set(keys)
        for key, nbytes, device, tag in self.live_peak.live_storages():
            if key in saved_alive or tag is None:
                continue  # created outside every forward of the module: not attributable to it
            storages.append(SavedStorage(tag, nbytes, device, "activation", stashed=True))
            keys.append(key)
            counts[tag] += 1
        self._snapshot, self._snapshot_keys, self._saver_counts = storages, keys, counts
        self._saved.clear()

    def __exit__(self, *exc) -> None:
        if self._exited or not self._entered:
            return
        self._exited = True
        try:
            if exc[0] is None:
                self.stop()
            else:
                self._stopped = True
                self._close_hooks()
        finally:
            self._exit_live_peak(*exc)

    def _exit_live_peak(self, *exc) -> None:
        try:
            if self._counting:
                self._counting = False
                self.live_peak.__exit__(*exc)
        finally:
            stance, self._stance = self._stance, None
            if stance is not None:
                stance.__exit__(None, None, None)

    def _close_hooks(self) -> None:
        ctx, self._hooks_ctx = self._hooks_ctx, None
        try:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._stack.clear()

    # -- hooks -------------------------------------------------------------------------------------
    def _current(self) -> str | None:
        return self._stack[-1] if self._stack else None

    def _make_pre(self, name: str) -> Callable:
        def pre(_mod, _args):
            self._stack.append(name)

        return pre

    def _make_post(self, name: str) -> Callable:
        def post(_mod, _args, _out):
            if self._stack and self._stack[-1] == name:
                self._stack.pop()
            elif name in self._stack:  # a forward raised between our hooks: unwind to the matching entry
                del self._stack[len(self._stack) - 1 - self._stack[::-1].index(name):]

        return post

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = storage_of(t)
        if storage is None:
            return t
        key = storage_key(storage)
        name = self._stack[-1] if self._stack else ""
        rec = self._saved.get(key)
        if rec is None or rec.ref() is None:
            rec = _Saved(
                name=name,
                nbytes=storage.nbytes(),
                device=str(t.device),
                kind="weight" if key in self._weight_keys else "activation",
                preexisting=not self.live_peak.is_tracked(t),
                ref=weakref.ref(storage),
            )
            self._saved[key] = rec
        rec.savers[name] += 1
        return t

    # -- result ------------------------------------------------------------------------------------
    def report(self, output: Any = None, *, include_peak: bool = False) -> SavedTensorReport:
        """Build the report; ``output`` (any nest of tensors, kept alive since :meth:`stop`) is not a stash.

        Storages shared with ``output`` that autograd saved stay counted (``output_bytes``); unsaved ones
        are dropped. ``include_peak`` fills ``peak_bytes`` with the LivePeak high-water mark so far.
        """
        if not self._entered:
            raise RuntimeError("report() needs a recorded forward: use the recorder as a context manager first")
        self.stop()
        if self._snapshot is None:
            raise RuntimeError("nothing to report: the recorded block raised before the forward finished")
        out_keys = {storage_key(t) for t in iter_tensors(output) if storage_of(t) is not None}
        storages: list[SavedStorage] = []
        counts = Counter(self._saver_counts)
        for key, s in zip(self._snapshot_keys, self._snapshot):
            if key in out_keys:
                if s.stashed:
                    counts[s.name] -= 1
                    continue
                s = SavedStorage(**{**asdict(s), "output": True})
            storages.append(s)
        return self._build(storages, counts, include_peak)

    def _group(self, name: str) -> str:
        if self.depth is None or not name:
            return name
        return ".".join(name.split(".")[: self.depth])

    def _build(self, storages: list[SavedStorage], counts: Counter, include_peak: bool) -> SavedTensorReport:
        rows: dict[str, SavedTensorRow] = {}

        def row(name: str) -> SavedTensorRow:
            g = self._group(name)
            if g not in rows:
                rows[g] = SavedTensorRow(g)
            return rows[g]

        for name, n in counts.items():
            if n > 0:
                row(name).num_tensors += n
        for s in storages:
            r = row(s.name)
            if s.kind == "weight":
                r.weight_bytes += s.nbytes
            else:
                r.activation_bytes += s.nbytes
                if s.stashed:
                    r.stashed_bytes += s.nbytes
        order = sorted(rows.values(), key=lambda r: (self._order.get(r.name, len(self._order)), r.name))
        acts = [s for s in storages if s.kind == "activation"]
        return SavedTensorReport(
            rows=order,
            total_activation_bytes=sum(s.nbytes for s in acts),
            total_weight_bytes=sum(s.nbytes for s in storages if s.kind == "weight"),
            stashed_bytes=sum(s.nbytes for s in acts if s.stashed),
            preexisting_bytes=sum(s.nbytes for s in acts if s.preexisting and not s.output),
            output_bytes=sum(s.nbytes for s in acts if s.output),
            forward_peak_bytes=self.forward_peak_bytes,
            peak_bytes=self.live_peak.peak_bytes if include_peak else None,
            depth=self.depth,
            storages=storages,
        )


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _check_depth(depth: Any) -> None:
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise ValueError(f"depth must be None (full module names) or an int >= 1, got {depth!r}")


def _default_loss(output: Any) -> torch.Tensor:
    parts = [t.float().sum() for t in iter_tensors(output) if t.is_floating_point() and t.requires_grad]
    if not parts:
        raise RuntimeError(
            "backward=True but the output holds no floating tensor that requires grad; pass loss_fn or make "
            "some parameter or input require grad"
        )
    return torch.stack(parts).sum() if len(parts) > 1 else parts[0]


def profile_saved_tensors(
    module: nn.Module,
    *args: Any,
    backward: bool = False,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    depth: int | None = None,
    **kwargs: Any,
) -> SavedTensorReport:
    """Run ``module(*args, **kwargs)`` once and report, per module, the bytes kept alive for backward.

    Args:
        module: the model; every submodule gets a forward pre/post hook for the duration of the call.
        backward: also run backward through ``loss_fn(output)`` and record ``peak_bytes`` (the LivePeak
            high-water mark of forward + backward). Parameters' ``.grad`` are restored afterwards.
        loss_fn: maps the output to a scalar loss (default: the sum of every floating output tensor).
        depth: ``None`` keeps full module names; ``k`` groups rows by the first ``k`` name components.

    Raises ``RuntimeError`` under ``torch.no_grad()``/``inference_mode`` (nothing would be saved).

    Example::

        >>> import torch
        >>> from lightning_memkit.memory import profile_saved_tensors
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> r = profile_saved_tensors(net, torch.randn(2, 8), backward=True)
        >>> r.peak_bytes >= r.forward_peak_bytes
        True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(backward, bool):
        raise TypeError(f"backward must be a bool, got {type(backward).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
    _check_depth(depth)
    with SavedTensorRecorder(module, depth=depth) as rec:
        output = module(*args, **kwargs)
        rec.stop()
        if backward:
            _measured_backward(module, output, loss_fn, (args, kwargs))
    return rec.report(output=output, include_peak=backward)


def _measured_backward(module: nn.Module, output: Any, loss_fn: Callable | None, inputs: Any) -> None:
    leaves = [p for p in module.parameters() if p.requires_grad]
    leaves += [t for t in iter_tensors(inputs) if t.requires_grad and t.is_leaf]
    previous = [(t, t.grad) for t in leaves]
    loss = (loss_fn or _default_loss)(output)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn must return a one-element tensor, got {type(loss).__name__}")
    if not loss.requires_grad:
        raise RuntimeError("the loss does not require grad: nothing to run backward through")
    try:
        loss.backward()
    finally:
        for t, g in previous:
            t.grad = g
