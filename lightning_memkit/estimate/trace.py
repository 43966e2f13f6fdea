"""The bookkeeping behind :func:`~lightning_memkit.memory.estimate_training_memory`: live bytes by category.

:class:`CategoryTracker` is a :class:`~lightning_memkit.memory.LivePeak` (same rules: unique storages,
bytes by device, freed when the storage dies) that also files every live storage under one category
(weights, gradients, optimizer state, saved activations, loss/logits, transient) and, at each new high-water
mark of the current phase, keeps the split and the module that was running. It counts real and fake
tensors alike: a ``FakeTensor``'s storage has its real size and dies with it.

:class:`FakeKernelGaps` sits between the tracker and ``FakeTensorMode``: ops whose inputs are all real
tensors run for real (a stated expert routing is real data), and ``aten._grouped_mm`` in a dtype its meta
kernel refuses is shaped through bfloat16 (the CPU kernel accepts float32; only the meta check does not).

Example::

    >>> import torch
    >>> from lightning_memkit.estimate.trace import CategoryTracker
    >>> with CategoryTracker() as tr:
    ...     tr.start_phase("forward", "transient")
    ...     a = torch.empty(256)                      # 1 KiB, transient
    ...     tr.move([a], "saved activations")
    ...     b = torch.empty(512)                      # 2 KiB
    ...     del b
    >>> tr.phase_peaks["forward"].peak_bytes, tr.phase_peaks["forward"].split["saved activations"]
    (3072, 1024)
"""

from __future__ import annotations

import bisect
import contextlib
import warnings
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memkit.measure.fake_repeat import allocation_factor, repeat_factor
from lightning_memkit.measure.live_peak import HOST, LivePeak, StorageEntry, device_key
from lightning_memkit.measure.storage import has_storage, iter_op_tensors, storage_key, storage_of

__all__ = ["CATEGORIES", "CategoryTracker", "EventLog", "ExpertRouting", "FakeKernelGaps", "FlopCount", "PhasePeak",
           "balanced_routing", "fake_module_conversion", "fake_tensors"]

CATEGORIES = ("weights", "gradients", "optimizer state", "saved activations", "loss/logits", "transient")


@dataclass
class PhasePeak:
    """The high-water mark of one phase: its bytes, their split by category and the module running then."""

    peak_bytes: int = 0
    split: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    layer: str = ""


class ModuleClock:
    """Which module runs now: a forward stack from global module hooks, and the autograd sequence numbers each module
    call spans, so that a backward node names the innermost module call whose forward created it."""

    def __init__(self, names: dict[int, str]):
        self.names = names
        self.stack: list[str] = []
        self._open: list[int] = []  # indices in calls of the calls running now
        self.starts: list[int] = []  # first sequence number of each call, in call order (sorted)
        self.calls: list[list[Any]] = []  # [start, end (None while running), name, enclosing call or -1]
        self._handles: list[Any] = []

    def install(self) -> None:
        hooks = nn.modules.module
        self._handles = [hooks.register_module_forward_pre_hook(self._pre),
                         hooks.register_module_forward_hook(self._post, always_call=True)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, module: nn.Module, _args: Any) -> None:
        name = self.names.get(id(module), type(module).__name__)
        start = torch._C._autograd._get_sequence_nr()
        self.stack.append(name)
        self.calls.append([start, None, name, self._open[-1] if self._open else -1])
        self.starts.append(start)
        self._open.append(len(self.calls) - 1)

    def _post(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        if not self.stack:
            return
        self.stack.pop()
        self.calls[self._open.pop()][1] = torch._C._autograd._get_sequence_nr()

    def current(self) -> str:
        """The innermost running module (forward or recompute), else the module of the running backward node."""
        if self.stack:
            return self.stack[-1]
        node = torch._C._current_autograd_node()
        if node is None:
            return ""
        seq = node._sequence_nr()
        i = bisect.bisect_right(self.starts, seq) - 1
        while i >= 0:  # the last call started by then, or the call around it that still ran
            start, end, name, outer = self.calls[i]
            if end is not None and start <= seq < end:
                return f"{name} ({node.name()})"
            i = outer
        return node.name()


class CategoryTracker(LivePeak):
    """``LivePeak`` with each storage filed under a category and the split kept at each phase's peak.

    New storages get :attr:`category`; :meth:`move` refiles storages. :meth:`start_phase` opens a phase
    whose high-water mark starts from the bytes alive now; ``phase_peaks[name]`` holds its
    :class:`PhasePeak`. ``clock`` (optional) names the running module at each peak. Host storages
    (:func:`~lightning_memkit.measure.live_peak.host_memory`, ``note_host``: offloaded bytes) are in no category
    total and no phase peak, which count device bytes; ``host_peaks[name]`` is each phase's host high-water mark.
    """

    def __init__(self, clock: ModuleClock | None = None):
        super().__init__()
        self.category = "transient"
        self.totals = dict.fromkeys(CATEGORIES, 0)
        self.phase_peaks: dict[str, PhasePeak] = {}
        self.host_peaks: dict[str, int] = {}
        self.phase: str | None = None
        self.clock = clock
        self.serial = 0
        self.allocated = 0  # bytes of the storages created while a phase records
        self.allocated_by_phase: dict[str, int] = {}  # the same, per phase
        self.log: EventLog | None = None  # every allocation of a recording phase, for the composition
        self.largest = Largest()  # the largest storage a recording phase made, and the largest square ones
        self._inputs: set[int] = set()

    def start_phase(self, name: str | None, category: str) -> None:
        """Open phase ``name`` (``None``: stop recording) with new storages filed under ``category``."""
        self.category = category
        self.phase = name
        if name is not None:
            self.phase_peaks[name] = PhasePeak()
            self.host_peaks[name] = self.host_live_bytes
            self._snapshot()
            if self.log is not None:
                self.log.start(self)

    def move(self, tensors: Iterable[Any], category: str, *, unless: tuple[str, ...] = ()) -> None:
        """File the tracked storages of ``tensors`` under ``category`` (those now in ``unless`` stay)."""
        with self._lock:
            for t in tensors:
                if has_storage(t):
                    self._refile(self._entries.get(storage_key(t)), category, unless)

    def move_since(self, serial: int, source: str, category: str) -> None:
        """Refile storages of ``source`` created at or after allocation number ``serial``."""
        with self._lock:
            for entry in self._entries.values():
                if entry.tag[0] == source and entry.tag[1] >= serial:
                    self._refile(entry, category, ())

    def _refile(self, entry: StorageEntry | None, category: str, unless: tuple[str, ...]) -> None:
        if entry is None or entry.tag[0] == category or entry.tag[0] in unless:
            return
        if entry.device != HOST:
            self.totals[entry.tag[0]] -= entry.nbytes
            self.totals[category] += entry.nbytes
        entry.tag[0] = category

    # -- LivePeak's bookkeeping, with the category totals kept alongside -----------------------------
    def _observe(self, out: Any, inputs: set[int]) -> None:
        self._inputs = inputs  # the op's input storages: where an allocation comes from (EventLog)
        super()._observe(out, inputs)

    def _add(self, t: torch.Tensor, key: int) -> None:
        storage = storage_of(t)
        nbytes = storage.nbytes()
        device = device_key(t)
        tag = [self.category, self.serial]
        self.serial += 1
        ref = weakref.ref(storage, lambda _r, key=key: self._remove(key))
        with self._lock:
            self._entries[key] = StorageEntry(nbytes, device, tag, ref)
            if device == HOST:  # offloaded: not in the device totals, the step's bytes or the composition's rows
                self._change(device, nbytes)
                return
            if self.phase is not None:
                self.largest.note(t, nbytes, self.clock)
                counted = nbytes * allocation_factor()  # a loop's one iteration standing for all (fake_repeat)
                self.allocated += counted
                self.allocated_by_phase[self.phase] = self.allocated_by_phase.get(self.phase, 0) + counted
            self.totals[tag[0]] += nbytes
            self._change(device, nbytes)
            if self.log is not None and self.phase is not None:
                self.log.note(self, key, nbytes, tag[1])

    def _remove(self, key: int) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                if entry.device != HOST:
                    self.totals[entry.tag[0]] -= entry.nbytes
                self._change(entry.device, -entry.nbytes)
                if self.log is not None:
                    self.log.owner.pop(key, None)

    def _resync(self, t: torch.Tensor) -> None:
        entry = self._entries.get(storage_key(t)) if has_storage(t) else None
        if entry is None:
            return
        with self._lock:
            delta = storage_of(t).nbytes() - entry.nbytes
            if entry.device != HOST:
                self.totals[entry.tag[0]] += delta
            entry.nbytes += delta
            self._change(entry.device, delta)
            if delta > 0 and entry.device != HOST and self.log is not None and self.phase is not None:
                self.log.note(self, storage_key(t), delta, entry.tag[1])  # a storage grown in place (FSDP2's)

    def _to_host(self, t: torch.Tensor) -> None:
        with self._lock:
            entry = self._entries.get(storage_key(t)) if has_storage(t) else None
            if entry is not None and entry.device != HOST:
                self.totals[entry.tag[0]] -= entry.nbytes
            super()._to_host(t)

    def _change(self, device: str, delta: int) -> None:
        super()._change(device, delta)
        if self.phase is None:
            return
        if device == HOST:
            self.host_peaks[self.phase] = max(self.host_peaks[self.phase], self.host_live_bytes)
        elif delta > 0 and self.live_bytes > self.phase_peaks[self.phase].peak_bytes:
            self._snapshot()

    def _snapshot(self) -> None:
        layer = self.clock.current() if self.clock is not None else ""
        self.phase_peaks[self.phase] = PhasePeak(self.live_bytes, dict(self.totals), layer)


@dataclass
class Largest:
    """The largest storage made while a phase records (its bytes, shape and the module running) and, per side, the
    largest with two equal trailing dimensions (``(..., n, n)``: an attention matrix or mask, at ``n`` tokens)."""

    nbytes: int = 0
    shape: tuple[int, ...] = ()
    module: str = ""
    squares: dict[int, tuple[int, str]] = field(default_factory=dict)  # side -> (bytes, module)

    def note(self, t: torch.Tensor, nbytes: int, clock: Any) -> None:
        side = int(t.shape[-1]) if t.dim() >= 2 and t.shape[-1] == t.shape[-2] > 1 else 0
        larger_square = side > 0 and nbytes > self.squares.get(side, (0, ""))[0]
        if nbytes <= self.nbytes and not larger_square:
            return
        where = clock.current() if clock is not None else ""
        if nbytes > self.nbytes:
            self.nbytes, self.shape, self.module = nbytes, tuple(t.shape), where
        if larger_square:
            self.squares[side] = (nbytes, where)


class EventLog:
    """Every allocation of a :class:`CategoryTracker`'s recording phases, for composing a step from its layers.

    Per phase, one row per allocation: the decoder layer it belongs to, its bytes, the live bytes after it and
    their split by category (:data:`CATEGORIES`), the tracker's allocation number and the running module's name.
    An allocation belongs to the layer whose module runs (the forward stack or, in backward, the module whose
    forward created the autograd node); else, in backward, to the layer the forward op that made the node
    belonged to; else to the latest layer whose storages the op reads: storages of a layer's parameters,
    gradients and optimizer state are claimed with :meth:`claim`, and each allocation passes its layer on to the
    storages it creates. The layer is coded ``j`` inside layer ``j``'s modules or where no
    module runs (the optimizer step, a conversion), ``-2 - j`` for work on layer ``j``'s tensors in another
    module (the head reading the last layer's output, a router loss looping over the layers' logits), ``-1`` for
    none. ``layer_of`` maps a module name (as :class:`ModuleClock` gives it) to its layer.
    """

    def __init__(self, layer_of: dict[str, int]):
        self.layer_of = layer_of
        self.owner: dict[int, int] = {}  # storage key -> layer
        self.node_owner: dict[int, int] = {}  # autograd sequence number -> layer of the forward op (or -1)
        self.rows: dict[str, list[tuple]] = {}
        self.names: list[str] = []
        self._name_index: dict[str, int] = {}

    def claim(self, tensors: Iterable[Any], layer: int) -> None:
        """File the storages of ``tensors`` as ``layer``'s (inputs that make an allocation belong to it)."""
        for t in tensors:
            if has_storage(t):
                self.owner[storage_key(t)] = layer

    def note(self, tracker: CategoryTracker, key: int, nbytes: int, serial: int) -> None:
        clock = tracker.clock
        name = clock.current() if clock is not None else ""
        owner = self.layer_of.get(name.split(" (", 1)[0], -1) if name else -1
        layer = owner
        if owner < 0:
            node = torch._C._current_autograd_node() if name and not clock.stack else None
            if node is not None and node._sequence_nr() in self.node_owner:  # where its forward op was
                owner = self.node_owner[node._sequence_nr()]
            else:  # the latest layer whose tensors the op reads
                owner = max((self.owner[k] for k in tracker._inputs if k in self.owner), default=-1)
            layer = -1 if owner < 0 else owner if not name else -2 - owner  # outside a layer's modules: -2 - j
        if owner >= 0:
            self.owner[key] = owner
        if clock is not None and clock.stack:  # a forward op: autograd numbered its node (if any) just before
            self.node_owner.setdefault(torch._C._autograd._get_sequence_nr() - 1, owner)
        index = self._name_index.get(name)
        if index is None:
            index = self._name_index[name] = len(self.names)
            self.names.append(name)
        totals = tracker.totals
        self.rows.setdefault(tracker.phase, []).append(
            (layer, nbytes, tracker.live_bytes, *(totals[c] for c in CATEGORIES), serial, index))

    def start(self, tracker: CategoryTracker) -> None:
        """A row for the opening of the tracker's current phase (its high-water mark starts there)."""
        totals = tracker.totals
        self.rows[tracker.phase] = [(-1, 0, tracker.live_bytes, *(totals[c] for c in CATEGORIES), -1, -1)]


class ExpertRouting:
    """The stated routing of the MoE expert module running now, for the data-dependent ops of its forward.

    Under fake tensors the router's choices have no values, so an expert loop's ``nonzero`` (which experts
    are hit, which tokens each gets) cannot run. While an expert module runs (between :meth:`enter` and
    :meth:`leave`, its forward pre- and post-hooks), :meth:`nonzero` answers with a uniform balance: every
    expert is hit, and the ``k``-th per-expert mask asked for selects expert ``k``'s share of
    :func:`balanced_routing` (``tokens * top_k / num_experts`` tokens). Outside, ``None``: no answer.
    """

    def __init__(self) -> None:
        self.shape: tuple[int, int, int] | None = None  # tokens, top_k, experts
        self.asked = 0

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        index = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                      and a.dtype == torch.long and a.dim() == 2), None)
        if index is not None:
            self.shape, self.asked = (index.shape[0], index.shape[1], module.num_experts), 0

    def leave(self, *_: Any) -> None:
        self.shape = None

    def nonzero(self, t: torch.Tensor) -> torch.Tensor | None:
        """Real indices for ``nonzero`` of a fake mask inside an expert module (see the class doc), else ``None``;
        fake ones of the same shape where the real ones would take more than :data:`REAL_OP_BYTES`."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        if self.shape is None:
            return None
        tokens, top_k, experts = self.shape
        if t.dim() != 1 and tokens * top_k * 8 > REAL_OP_BYTES:  # fake (shape only): no memory per token
            expert, self.asked, slots = self.asked % experts, self.asked + 1, tokens * top_k
            return torch.empty((slots // experts + (expert < slots % experts), 2), dtype=torch.long, device=t.device)
        with unset_fake_temporarily():
            if t.dim() == 1:  # which experts are hit: all of them
                return torch.arange(min(experts, t.shape[0]), dtype=torch.long).view(-1, 1)
            expert, self.asked = self.asked % experts, self.asked + 1
            routing = balanced_routing(tokens, top_k, experts)
            token, pos = (routing == expert).nonzero(as_tuple=True)
            if t.shape == (top_k, tokens):  # a (top_k, tokens) mask: (position, token) pairs
                return torch.stack([pos, token], dim=1)
            return torch.stack([token, pos], dim=1)


class FlopCount(TorchDispatchMode):
    """The matmul, convolution and attention FLOPs of the ops run inside (:attr:`total`), by torch's own formulas
    (``FlopCounterMode``'s registry). ``FlopCounterMode`` itself also tracks modules, and its hooks keep
    checkpointed tensors alive, which would change the peak being estimated."""

    def __init__(self) -> None:
        super().__init__()
        from lightning_memkit.estimate.flops import flop_registry

        self.registry = flop_registry()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.registry.get(func.overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out)) * repeat_factor()
        return out


class FakeKernelGaps(TorchDispatchMode):
    """Between the tracker and ``FakeTensorMode``: what fake tensors cannot do by themselves.

    - ops whose tensor inputs are all real run for real (a real batch: labels are checked, counted), and so
      does ``arange`` of integers (positions: their values follow from the shapes; a model that reads them,
      as transformers' mask builder does, must see real values, since it treats a fake one as a trace); unless
      they expand their inputs past :data:`REAL_OP_BYTES` (a ``T x T`` mask, token indices in an expert module):
      those are fake, and no host memory grows with the batch or the sequence beyond the positions;
    - ``nonzero`` inside an MoE expert module is answered by :class:`ExpertRouting` (a stated balance);
    - ``aten._grouped_mm`` in float32: its meta kernel accepts bfloat16 only while the CPU kernel also runs
      float32; the output is shaped through bfloat16 and returned in the input's dtype (same bytes).
    """

    def __init__(self, routing: ExpertRouting | None = None):
        super().__init__()
        self.routing = routing or ExpertRouting()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no per-call dynamo-disabling trampoline (see FastOps): nothing compiles inside a fake step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        if func is _DEVICE and type(args[0]) is FakeTensor and not args[0].fake_mode.in_kernel_invocation:
            return args[0].fake_device  # as FakeTensorMode answers it (the tracker asks for every storage)
        kwargs = kwargs or {}
        real = self._real(func, args, kwargs)
        if real == "sized":
            out = _shaped(func, args, kwargs)  # its size decides: fake outputs where it expands
            if out is not None:
                return out
        if real:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func is torch.ops.aten.nonzero.default:
            answer = self.routing.nonzero(args[0])
            if answer is not None:
                return answer
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            dtype = kwargs.get("out_dtype") or args[0].dtype
            low = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
            return func(*low, **{**kwargs, "out_dtype": None}).to(dtype)
        return func(*args, **kwargs)

    def _real(self, func: Any, args: tuple, kwargs: dict) -> bool | str:
        """``True``: the op runs for real; ``"sized"``: for real unless it expands (:func:`_expands`); ``False``:
        fake. Integer ``arange`` is real (positions), or sized inside an expert module (token indices); an op of
        real tensors only is sized, or real when it is a view or writes in place."""
        from torch._subclasses.fake_tensor import FakeTensor

        if self._integer_range(func, args, kwargs):
            return True if self.routing.shape is None else "sized"
        tensors = list(iter_op_tensors(args)) + list(iter_op_tensors(kwargs.values()))
        if not tensors or any(isinstance(t, FakeTensor) for t in tensors):
            return False
        return True if func.is_view or func._schema.is_mutable else "sized"

    @staticmethod
    def _integer_range(func: Any, args: tuple, kwargs: dict) -> bool:
        """``torch.arange`` of integers: positions and indices whose values the shapes alone fix."""
        if func.overloadpacket is not torch.ops.aten.arange:
            return False
        dtype = kwargs.get("dtype")
        return dtype in _INTEGER_DTYPES or (dtype is None and all(isinstance(a, int) for a in args))


_INTEGER_DTYPES = (torch.int64, torch.int32)
_DEVICE = torch.ops.prim.device.default
#: an op of real tensors whose outputs take more than this, and 64 times its inputs (a ``T x T`` attention mask
#: from positions, token indices in an expert module), gives fake outputs (shape only: no host memory in
#: proportion to the batch; a data-dependent op on them raises)
REAL_OP_BYTES = 2**24


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors if has_storage(t))


def _shaped(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func``'s outputs on the fake mode below where they expand (:func:`_expands`), else ``None`` (the op then
    runs for real): their sizes from the op's meta kernel on ``meta`` copies of the real inputs first (no copy of
    values, unlike a real tensor entering fake mode); ``None`` too where a meta or fake kernel cannot run it (it
    reads values: ``item()``, ``nonzero``; or it has none), as before any size test."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._pytree import tree_map

    def meta(x: Any) -> Any:
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    try:
        with unset_fake_temporarily():
            sized = func(*tree_map(meta, args), **tree_map(meta, kwargs))
        return func(*args, **kwargs) if _expands(sized, args, kwargs) else None
    except Exception:  # whatever meta or fake tensors refuse, the real op decides (and raises if it must)
        return None


def _expands(out: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the outputs ``out`` of an op (``meta``: shapes only) take more than :data:`REAL_OP_BYTES` and 64 times
    its (real) inputs."""
    size = sum(t.untyped_storage().nbytes() for t in iter_op_tensors([out]))
    return size > REAL_OP_BYTES and size > 64 * _nbytes([*iter_op_tensors(args), *iter_op_tensors(kwargs.values())])


@contextlib.contextmanager
def fake_module_conversion() -> Iterator[None]:
    """``Module.to(dtype)`` on fake parameters: ``nn.Module._apply`` swaps a ``FakeTensor`` parameter with its
    converted copy, which ``torch.utils.swap_tensors`` refuses while fake mode holds a weak reference to it;
    inside the block such a swap sets the parameter's data instead (same storage, same bytes), as ``_apply``
    does for plain tensors. Restored on exit."""
    from torch._subclasses.fake_tensor import FakeTensor

    original = torch.utils.swap_tensors

    def swap(t1: Any, t2: Any) -> None:
        if isinstance(t1, FakeTensor) and (weakref.getweakrefcount(t1) or weakref.getweakrefcount(t2)):
            t1.data = t2.detach()
            return
        original(t1, t2)

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


def balanced_routing(tokens: int, top_k: int, num_experts: int) -> torch.Tensor:
    """A real ``(tokens, top_k)`` int64 routing where expert loads differ by at most one token.

    Token ``t``'s ``j``-th choice is expert ``(t * top_k + j) % num_experts``: distinct experts per token
    (``top_k <= num_experts``) and ``tokens * top_k / num_experts`` tokens per expert, rounded.

    Example::

        >>> balanced_routing(4, 2, 4).tolist()
        [[0, 1], [2, 3], [0, 1], [2, 3]]
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return (torch.arange(tokens * top_k, dtype=torch.long) % num_experts).view(tokens, top_k)


@contextlib.contextmanager
def fake_tensors(gaps: FakeKernelGaps | None = None) -> Iterator[FakeKernelGaps]:
    """Tensors made in the block are fake (shapes, dtypes and storage sizes, no memory), with
    :class:`FakeKernelGaps` and :func:`fake_module_conversion`; trackers open around the block keep their
    peak (:func:`~lightning_memkit.measure.live_peak.unmeasured`). Yields the ``FakeKernelGaps`` mode; a tracker
    entered inside the block counts the fake storages.

    Example::

        >>> with fake_tensors():
        ...     w = torch.empty(1 << 40, dtype=torch.uint8)   # 1 TiB, nothing allocated
        >>> w.untyped_storage().nbytes() == 1 << 40
        True
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_memkit.measure.live_peak import unmeasured

    gaps = gaps or FakeKernelGaps()
    with (warnings.catch_warnings(), unmeasured(), FakeTensorMode(allow_non_fake_inputs=True), gaps,
          fake_module_conversion()):
        # a fake tensor's data_ptr() is 0: code comparing pointers (to skip a copy) only warns; nothing allocates
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        yield gaps
