"""A training step's estimate composed from traces of the same model at a few small depths.

The decoder layers of a transformers causal LM repeat, and the step's memory at each allocation is a sum over
storages: the layers' weights, gradients and optimizer state, each layer's saved activations, the embedding's
and the head's, and the temporaries of the op running. How many of each a layer holds depends on its kind and
on whether the step has passed it yet (forward: the layers before the running one hold their saved
activations; backward: the layers after it have freed theirs and made their gradients), not on the depth. So
the live bytes after the ``k``-th allocation of a layer of kind ``K`` are an affine function of the numbers of
layers of each kind before and after it (weights of layers not yet run, activations of those already run,
...) and of whether there is any (a storage the layers of a kind share, such as an attention mask, lives while
one of them is left to run), and the live bytes after an allocation outside the layers (embedding, head, loss,
optimizer step of the other parameters) an affine function of the numbers of layers of each kind. Work outside
the layers' modules on one layer's tensors (the head reading the last layer's output, a router loss looping
over the layers' logits) is that layer's "outside" zone, a repeated part of its own.

:func:`compose_step` traces the model (every allocation of the two-step estimate, logged by
:class:`~lightning_memkit.estimate.trace.EventLog` with the layer it belongs to) at depths 3, 4 and 5, more when
a layer kind needs them, fits those functions exactly (integer bytes, rational coefficients) on the samples,
and evaluates every allocation of the full depth, layer by layer: a phase's peak is the largest of them, the
split by category and the running module those of that allocation. The maximum is taken over the allocations of
the real depth, never extrapolated from the samples' peaks: a peak that moves from the embedding to the last
layer, or from the first layer's backward to the last's, as the depth grows, is found where it is.

Kinds and checks, any of which failing means the whole model is traced instead (and the estimate says why):

- a layer's kind is its module structure (classes, parameter shapes and dtypes, attributes such as
  ``sliding_window`` or ``attention_type``; the layer index aside), read from the model built on the ``meta``
  device; the sample of depth ``d`` is the config with ``num_hidden_layers = d`` and every per-layer list
  (``layer_types``, ``mlp_only_layers``...) cut to the first ``d`` layers, whose layers must have the kinds of
  the model's first ``d``: sliding and full attention layers (Gemma, GPT-OSS), DeepSeek-V3's dense first layers
  (``first_k_dense_replace``), Qwen-MoE's dense layers (``mlp_only_layers``, ``decoder_sparse_step``) are
  kinds of their own;
- in the traces, layers of one kind allocate the same sizes in the same order (a first or last layer that does
  not, such as the first one of a QLoRA model, whose input needs no gradient, is a kind of its own), and each
  layer of the full model gets the kind the samples show at its position (first, last, first or last of its
  module kind, in between; failing that, the one kind of its module kind elsewhere in between);
- every fitted function reproduces every sample exactly, with at least one sample more than it has unknowns (so
  that the fit is a check, not an interpolation), and the full depth's counts are a combination of the samples'.

Example (an 8-layer tiny Llama, composed from depths 3, 4 and 5; the same bytes as its full trace)::

    >>> import pathlib, tempfile
    >>> from lightning_memkit.demo.hf_models import tiny_hf_config
    >>> from lightning_memkit.estimate.hf import estimate_from_hf_config
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "config.json"
    >>> _ = path.write_text(tiny_hf_config("llama", num_layers=8).to_json_string())
    >>> composed = estimate_from_hf_config(path, seq_len=16, precision="bf16-true", compose=True)
    >>> full = estimate_from_hf_config(path, seq_len=16, precision="bf16-true", compose=False)
    >>> [p.peak_bytes for p in composed.phases] == [p.peak_bytes for p in full.phases]
    True
    >>> any(a.startswith("composed from") for a in composed.assumptions)
    True
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from math import lcm
from typing import Any

import numpy as np

from lightning_memkit.estimate.step import STEP_PHASES, PhaseEstimate, StepTrace
from lightning_memkit.estimate.trace import CATEGORIES

__all__ = ["FIRST_DEPTHS", "MAX_DEPTH", "NotComposable", "compose_step", "layer_signatures", "traced",
           "truncated_config", "workers"]

#: the depths traced first: three samples with inner layers, so that the first and the last layer may be kinds of
#: their own (QLoRA's first layer needs no input gradient; an MoE model's last allocates differently) and every
#: fit still has a sample to check it; more are added (up to :data:`MAX_DEPTH`) when a layer kind needs them
FIRST_DEPTHS = (3, 4, 5)
MAX_DEPTH = 8
_PHASES = ("load", *STEP_PHASES)
_WIDTH = 1 + len(CATEGORIES)  # per allocation: the live bytes, then their split
_LAYER_ATTRIBUTES_SKIPPED = ("layer_idx", "layer_id", "training")
_INDEX_LISTS = ("mlp_only_layers",)  # lists of layer indices (a per-layer list is one entry per layer)
_SIMPLE = (bool, int, float, str, type(None))


class NotComposable(Exception):
    """Why the step could not be composed from its layers (the whole model is traced instead)."""


class _NeedDepth(NotComposable):
    """The samples traced so far do not determine (or check) a function the full depth needs."""


class _Inconsistent(NotComposable):
    """A fitted function does not reproduce a sample."""


# -- layer kinds ----------------------------------------------------------------------------------------------
def layer_signatures(config: Any) -> list[tuple]:
    """Per decoder layer of the causal LM ``config`` builds (on ``meta``: no memory), its kind: the classes,
    parameter and buffer shapes and dtypes, and the plain attributes of its modules, the layer index aside."""
    import torch
    import transformers

    from lightning_memkit.estimate.step import layer_blocks

    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config)
    return [_signature(block) for _, block in layer_blocks(model)]


def _signature(block: Any) -> tuple:
    def plain(value: Any) -> bool:
        return isinstance(value, _SIMPLE) or (isinstance(value, tuple) and all(isinstance(v, _SIMPLE) for v in value))

    parts = []
    for name, module in block.named_modules():
        attributes = tuple(sorted((k, v) for k, v in vars(module).items()
                                  if not k.startswith("_") and k not in _LAYER_ATTRIBUTES_SKIPPED and plain(v)))
        params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad)
                       for n, p in module.named_parameters(recurse=False))
        buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers(recurse=False))
        parts.append((name, type(module).__qualname__, attributes, params, buffers))
    return tuple(parts)


def truncated_config(config: Any, depth: int) -> Any:
    """``config`` with ``num_hidden_layers = depth``: every per-layer list (one entry per layer) cut to its first
    ``depth`` entries, and lists of layer indices (:data:`_INDEX_LISTS`) to the indices below ``depth``. Rules
    by index (``first_k_dense_replace``, ``decoder_sparse_step``) give the first ``depth`` layers the same kinds
    as before; :func:`compose_step` checks that with :func:`layer_signatures`."""
    layers = config.num_hidden_layers
    out = copy.deepcopy(config)
    for key, value in vars(config).items():
        if not isinstance(value, (list, tuple)):
            continue
        if key in _INDEX_LISTS:
            setattr(out, key, type(value)(i for i in value if isinstance(i, int) and i < depth))
        elif len(value) == layers and key != "architectures":
            setattr(out, key, type(value)(value[:depth]))
    out.num_hidden_layers = depth
    return out


# -- the samples ------------------------------------------------------------------------------------------------
#: the two zones of a layer's allocations: in its modules, and outside them on its tensors (``EventLog`` codes)
_ZONES = ("layer", "outside")


@dataclass
class _Rows:
    """The allocations of one zone of one layer (or of none) in one phase of one sample, in order."""

    values: np.ndarray  # rows x _WIDTH: live bytes and split after each allocation
    sizes: tuple[int, ...]
    names: list[str]
    order: list[int]  # each allocation's index among the phase's allocations
    after: list[int]  # per allocation: how many layers the phase had entered before it


@dataclass
class _Phase:
    """One phase of one sample: the allocations of no layer, and of each layer's two zones."""

    none: _Rows
    zones: dict[tuple[str, int], _Rows] = field(default_factory=dict)  # (zone, layer) -> rows
    ascending: bool = True  # the phase runs the layers first to last


def _phases(step: StepTrace, depth: int) -> dict[str, _Phase]:
    log = step.log
    out = {}
    for phase in _PHASES:
        rows = np.array(log.rows.get(phase, []), dtype=np.int64).reshape(-1, 3 + len(CATEGORIES) + 2)
        code, nbytes, values, names = rows[:, 0], rows[:, 1], rows[:, 2:2 + _WIDTH], rows[:, -1]
        seen: list[int] = []
        after = []
        for c in code.tolist():
            if c >= 0 and c not in seen:
                seen.append(c)
            after.append(len(seen))
        after_arr = np.asarray(after, dtype=np.int64)

        def select(mask: np.ndarray, nbytes=nbytes, values=values, names=names, after_arr=after_arr) -> _Rows:
            return _Rows(values[mask], tuple(nbytes[mask].tolist()),
                         [log.names[i] if i >= 0 else "" for i in names[mask].tolist()],
                         np.flatnonzero(mask).tolist(), after_arr[mask].tolist())

        p = _Phase(select(code == -1), ascending=seen == sorted(seen))
        for j in range(depth):
            p.zones[("layer", j)] = select(code == j)
            p.zones[("outside", j)] = select(code == -2 - j)
        out[phase] = p
    return out


def _tag(j: int, depth: int) -> str:
    return "first" if j == 0 else "last" if j == depth - 1 else "inner"


def _position(j: int, modules: list[tuple]) -> tuple[str, bool, bool]:
    """Where layer ``j`` sits among ``modules`` (the model's layer kinds): first, last or inner, and whether it is the
    first and the last of its kind (a storage its kind shares, an aux loss's first accumulation, ...)."""
    same = [i for i, m in enumerate(modules) if m == modules[j]]
    return _tag(j, len(modules)), j == same[0], j == same[-1]


def _counts(kinds: list[int], n_kinds: int) -> list[int]:
    return np.bincount(np.asarray(kinds, dtype=np.int64), minlength=n_kinds).tolist() if kinds else [0] * n_kinds


def _layer_features(kinds: list[int], j: int, n_kinds: int) -> list[int]:
    """``[1]``, the layers of each kind before ``j`` and after it, and whether there is any (a storage the layers
    of a kind share, such as an attention mask, lives while one of them is left to run; the first and the last
    layer differ from the others that way)."""
    before, after = _counts(kinds[:j], n_kinds), _counts(kinds[j + 1:], n_kinds)
    return [1, *before, *after, *(int(c > 0) for c in before), *(int(c > 0) for c in after)]


def _outside_features(kinds: list[int], n_kinds: int) -> list[int]:
    counts = _counts(kinds, n_kinds)
    return [1, *counts, *(int(c > 0) for c in counts)]


# -- exact affine fits ------------------------------------------------------------------------------------------
class _Affine:
    """Integer targets ``Y`` (one row per sample) as an affine function of small integer features ``X``: exact.

    The samples whose features are independent form a basis; every other sample must equal the combination of
    the basis with its features' coefficients (rational), for every target: :class:`_Inconsistent` otherwise,
    and :class:`_NeedDepth` when no sample is left over to check. :meth:`predict` evaluates the function at
    features in the basis's span (:class:`_NeedDepth` outside it)."""

    def __init__(self, X: list[list[int]], Y: np.ndarray, what: str):
        self.what = what
        rows = [[Fraction(v) for v in x] for x in X]
        self.basis, self.pivots = _independent(rows)
        if len(self.basis) == len(X):
            raise _NeedDepth(f"{what}: the samples have no degree of freedom left to check the fit")
        B = [rows[i] for i in self.basis]
        self.B = B
        self.inverse = _inverse([[r[c] for c in self.pivots] for r in B])
        self.Y = Y[self.basis]
        others = [i for i in range(len(X)) if i not in self.basis]
        predicted = self._combine([self._coefficients(rows[i]) for i in others])
        if not np.array_equal(predicted, Y[others]):
            raise _Inconsistent(f"{what}: the samples are not affine in the layer counts")

    def _coefficients(self, x: list[Fraction]) -> list[Fraction]:
        c = [sum((x[p] * self.inverse[k][i] for k, p in enumerate(self.pivots)), Fraction(0))
             for i in range(len(self.B))]
        if any(sum((c[i] * self.B[i][col] for i in range(len(c))), Fraction(0)) != x[col] for col in range(len(x))):
            raise _NeedDepth(f"{self.what}: the model's layer counts are not a combination of the samples'")
        return c

    def _combine(self, coefficients: list[list[Fraction]]) -> np.ndarray:
        if not coefficients:
            return np.zeros((0, self.Y.shape[1]), dtype=np.int64)
        scale = lcm(*(c.denominator for cs in coefficients for c in cs))
        numerators = np.array([[int(c * scale) for c in cs] for cs in coefficients], dtype=object)
        bound = int(np.abs(numerators).max()) * int(np.abs(self.Y).max(initial=0)) * len(self.basis)
        if bound < 2**62:
            total = numerators.astype(np.int64) @ self.Y
        else:  # Python integers: no overflow
            total = numerators @ self.Y.astype(object)
        if np.any(total % scale != 0):
            raise _Inconsistent(f"{self.what}: a prediction is not a whole number of bytes")
        return (total // scale).astype(np.int64)

    def predict(self, X: list[list[int]]) -> np.ndarray:
        return self._combine([self._coefficients([Fraction(v) for v in x]) for x in X])


def _independent(rows: list[list[Fraction]]) -> tuple[list[int], list[int]]:
    """Indices of a maximal independent subset of ``rows`` (greedy, in order) and one pivot column per row, such
    that those rows restricted to the pivot columns form an invertible matrix."""
    reduced: list[tuple[int, list[Fraction]]] = []
    chosen = []
    for i, row in enumerate(rows):
        v = list(row)
        for col, r in reduced:
            if v[col]:
                f = v[col] / r[col]
                v = [a - f * b for a, b in zip(v, r, strict=True)]
        col = next((k for k, a in enumerate(v) if a), None)
        if col is not None:
            reduced.append((col, v))
            chosen.append(i)
    return chosen, [col for col, _ in reduced]


def _inverse(m: list[list[Fraction]]) -> list[list[Fraction]]:
    """The inverse of a small invertible matrix (Gauss-Jordan over the rationals)."""
    n = len(m)
    a = [list(row) + [Fraction(int(i == j)) for j in range(n)] for i, row in enumerate(m)]
    for col in range(n):
        pivot = next(r for r in range(col, n) if a[r][col])
        a[col], a[pivot] = a[pivot], a[col]
        p = a[col][col]
        a[col] = [v / p for v in a[col]]
        for r in range(n):
            if r != col and a[r][col]:
                f = a[r][col]
                a[r] = [v - f * w for v, w in zip(a[r], a[col], strict=True)]
    return [row[n:] for row in a]


# -- composing ------------------------------------------------------------------------------------------------
def compose_step(config: Any, trace: Callable[[Any], StepTrace],
                 max_layers: int | None = None) -> tuple[StepTrace, str]:
    """The :class:`~lightning_memkit.estimate.step.StepTrace` of the causal LM ``config`` describes, composed from
    ``trace(sample_config)`` (a logged trace of the config cut to a few layers; module doc), and a line saying
    which depths it was composed from. Raises :class:`NotComposable` (with the reason) where it cannot be, or
    where the samples it would need hold more than ``max_layers`` layers in all (tracing the model is then
    cheaper)."""
    n = int(config.num_hidden_layers)
    real = layer_signatures(config)
    if len(real) != n:
        raise NotComposable(f"the model has {len(real)} decoder layers, the config says num_hidden_layers={n}")
    depths = [d for d in FIRST_DEPTHS if d < n - 1]
    if len(depths) < len(FIRST_DEPTHS):
        raise NotComposable(f"{n} layers: too few to compose from samples")
    samples: dict[int, tuple[StepTrace, dict[str, _Phase]]] = {}
    while True:
        cuts = {}
        for d in depths:
            if d not in samples:
                cuts[d] = truncated_config(config, d)
                if layer_signatures(cuts[d]) != real[:d]:
                    raise NotComposable(f"the layers of the config cut to {d} layers are not the model's first {d}")
        for d, step in traced(trace, cuts).items():
            if step.log is None or len(step.layers) != d:
                raise NotComposable(f"the sample of depth {d} has {len(step.layers)} decoder layers")
            samples[d] = (step, _phases(step, d))
        try:
            return _compose(samples, real), f"composed from traces at depths {', '.join(map(str, sorted(samples)))} " \
                f"of the {n} decoder layers (each allocation's bytes fitted exactly as affine in the layer counts, " \
                "then maximised layer by layer at the full depth)"
        except _NeedDepth as err:
            more = next((d for d in range(2, min(MAX_DEPTH, n - 2) + 1) if d not in depths), None)
            if more is None:
                raise NotComposable(str(err)) from None
            if max_layers is not None and sum(depths) + more > max_layers:
                raise NotComposable(f"{err}; more samples would trace more layers than the model has") from None
            depths.append(more)


#: the ways of telling layer kinds apart, coarsest first: by the allocations alone, then with the first and/or the
#: last layer a kind of its own, then by module structure too
_LEVELS = tuple((modules, tags) for modules in (False, True) for tags in ((), ("first", "last")))


def workers() -> int:
    """How many sample traces run at once: the CPU cores this process may use (``MEMKIT_ESTIMATE_WORKERS`` caps
    them; 1 traces in this process), where processes can be forked and no other thread runs in this one."""
    import os
    import threading

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        cap = int(os.environ.get("MEMKIT_ESTIMATE_WORKERS", cores))
    except ValueError:
        cap = cores
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods() or threading.active_count() > 1:
        return 1
    return max(1, min(cores, cap))


def traced(trace: Callable[[Any], StepTrace], cuts: dict[int, Any]) -> dict[int, StepTrace]:
    """``{depth: trace(cut)}``: in forked processes, one per cut, run :func:`workers` at a time (the traces are
    independent and single-threaded); in this process where only one runs at a time. A process's error is
    raised here."""
    n = workers()
    if n < 2 or len(cuts) < 2:
        return {d: trace(cut) for d, cut in cuts.items()}
    import gc
    import multiprocessing
    import sys

    context = multiprocessing.get_context("fork")
    sys.stdout.flush()
    sys.stderr.flush()
    # the children's collector leaves the objects they inherit alone (no copy-on-write of their pages); where the
    # caller froze objects already, their freeze is left as it is (unfreezing would undo it)
    own_freeze = gc.get_freeze_count() == 0
    if own_freeze:
        gc.freeze()
    try:
        return _run_forked(context, trace, cuts, n)
    finally:
        if own_freeze:
            gc.unfreeze()


def _run_forked(context: Any, trace: Callable[[Any], StepTrace], cuts: dict[int, Any], n: int,
                ) -> dict[int, StepTrace]:
    """:func:`traced`'s processes: ``n`` at a time, the largest cut first; a process's error is raised here."""
    import multiprocessing.connection

    out: dict[int, StepTrace] = {}
    pending = sorted(cuts, reverse=True)  # the largest first: the others fill in around it
    running: list[tuple[int, Any, Any]] = []
    while pending or running:
        while pending and len(running) < n:
            d = pending.pop(0)
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_trace_in_child, args=(send, trace, cuts[d]), daemon=True)
            process.start()
            send.close()
            running.append((d, process, receive))
        ready = multiprocessing.connection.wait([r for _, _, r in running])
        d, process, receive = next(item for item in running if item[2] is ready[0])
        running.remove((d, process, receive))
        try:
            status, value = receive.recv()
        except EOFError:
            status, value = "error", NotComposable(f"the process tracing depth {d} ended without a result "
                                                   f"(exit code {process.exitcode})")
        process.join()
        if status == "error":
            for _, other, _ in running:
                other.kill()
            raise value
        out[d] = value
    return out


def _trace_in_child(send: Any, trace: Callable[[Any], StepTrace], cut: Any) -> None:
    import torch

    torch.set_num_threads(1)  # the parent's thread pool is not this process's: run ops inline
    try:
        step = trace(cut)
        if step.log is not None:  # what composing reads: the rows and names
            step.log.owner, step.log.node_owner, step.log.layer_of = {}, {}, {}
        send.send(("ok", step))
    except BaseException as err:  # noqa: BLE001 (raised again in the parent)
        try:
            send.send(("error", err))
        except Exception:  # an error that does not pickle
            import traceback

            send.send(("error", RuntimeError(traceback.format_exc())))
    finally:
        send.close()


def _compose(samples: dict[int, tuple[StepTrace, dict[str, _Phase]]], real: list[tuple]) -> StepTrace:
    failure: NotComposable | None = None
    for by_modules, tags in _LEVELS:
        try:
            return _evaluate(samples, _Kinds(samples, real, by_modules, tags))
        except _Inconsistent as err:
            failure = err
    raise failure


class _Kinds:
    """The kind of each zone of each sample layer and of each layer of the full model: zones that allocate the same
    sizes in the same order, at a position in ``tags`` (first, last) or not, of one module structure or not
    (``by_modules``). The kinds of the layer zones are the features every fit counts."""

    def __init__(self, samples: dict[int, tuple[StepTrace, dict[str, _Phase]]], real: list[tuple],
                 by_modules: bool, tags: tuple[str, ...]):
        self.sample: dict[tuple[str, int, int], int] = {}  # (zone, depth, j) -> kind
        self.real: dict[str, list[int]] = {}  # zone -> kind of each layer of the full model
        ids: dict[tuple, int] = {}
        for zone in _ZONES:
            table = self._sample_zone(zone, samples, real, by_modules, tags, ids)
            self.real[zone] = [_real_kind(table, real, j) for j in range(len(real))]
        layer_kinds = sorted({k for (zone, _, _), k in self.sample.items() if zone == "layer"})
        index = {k: i for i, k in enumerate(layer_kinds)}
        self.n = len(layer_kinds)  # features: layers of each layer-zone kind
        self.sample_layers = {d: [index[self.sample[("layer", d, j)]] for j in range(d)] for d in samples}
        self.real_layers = [index[k] for k in self.real["layer"]]

    def _sample_zone(self, zone: str, samples: dict[int, tuple[StepTrace, dict[str, _Phase]]], real: list[tuple],
                     by_modules: bool, tags: tuple[str, ...], ids: dict[tuple, int]) -> dict[tuple, set[int]]:
        """The kind of ``zone`` of each sample layer, filed in ``sample``: the kinds per module kind and position."""
        table: dict[tuple, set[int]] = {}
        for d, (_, phases) in samples.items():
            for j in range(d):
                tag = _tag(j, d)
                key = (zone, tuple(phases[p].zones[(zone, j)].sizes for p in _PHASES),
                       tag if tag in tags else "", real[j] if by_modules else None)
                kind = ids.setdefault(key, len(ids))
                self.sample[(zone, d, j)] = kind
                table.setdefault((real[j], _position(j, real[:d])), set()).add(kind)
        return table


def _real_kind(table: dict[tuple, set[int]], real: list[tuple], j: int) -> int:
    """The kind of layer ``j`` of the full model: the one the samples show at its position, or at its tag."""
    found = table.get((real[j], _position(j, real)))
    if not found:  # a position no sample has: the kind its neighbours in the samples all have, if one
        found = _neighbour_kind(table, real, j)
    if not found:
        raise _missing_kind(real, j)
    if len(found) > 1:
        raise NotComposable(f"layers of the kind of layer {j} allocate differently at different positions")
    return next(iter(found))


def _neighbour_kind(table: dict[tuple, set[int]], real: list[tuple], j: int) -> set[int] | None:
    """The one kind the samples' layers of layer ``j``'s module kind have at its tag (first, last, inner), if one."""
    n = len(real)
    found = set().union(*(kinds for (sig, where), kinds in table.items()
                          if sig == real[j] and where[0] == _tag(j, n))) or None
    return found if found is not None and len(found) == 1 else None


def _missing_kind(real: list[tuple], j: int) -> _NeedDepth:
    """The error for layer ``j``, whose position no sample shows."""
    where = _position(j, real)
    return _NeedDepth(f"no sample has a layer of the kind of layer {j} where it is ({where[0]}"
                      + (", first of its kind" if where[1] else "")
                      + (", last of its kind" if where[2] else "") + ")")


def _evaluate(samples: dict[int, tuple[StepTrace, dict[str, _Phase]]], kinds: _Kinds) -> StepTrace:
    depths = sorted(samples)
    phases = [_evaluate_phase(phase, samples, kinds) for phase in _PHASES]
    steps = [samples[d][0] for d in depths]
    X = [_outside_features(kinds.sample_layers[d], kinds.n) for d in depths]
    features, feature_numbers = _feature_numbers(steps)
    totals = np.array([[s.flops, s.allocated, s.foreach_bytes, s.parameters, s.trainable_parameters, s.host_bytes,
                        s.optimizer_bytes, s.host_steady, s.parameter_bytes, *numbers]
                       for s, numbers in zip(steps, feature_numbers, strict=True)], dtype=np.int64)
    flops, allocated, foreach, parameters, trainable, host, optimizer, steady, parameter_bytes, *numbers = _Affine(
        X, totals, "the step's totals") \
        .predict([_outside_features(kinds.real_layers, kinds.n)])[0].tolist()
    phases[-1].peak_bytes += foreach
    phases[-1].transient += foreach
    first = steps[0]
    names = iter(numbers)
    text = [re.sub(r"\d+", lambda _m: str(next(names)), f) for f in features]
    return StepTrace(phases, parameters, trainable, first.precision, text, flops, allocated, first.target, foreach,
                     None, [], host, optimizer, steady, parameter_bytes, first.largest)


def _feature_numbers(steps: list[StepTrace]) -> tuple[list[str], list[list[int]]]:
    """The feature names of the first sample, and per sample the numbers in its names (which must read the same
    otherwise)."""
    skeletons = [[re.sub(r"\d+", "#", f) for f in s.features] for s in steps]
    if any(sk != skeletons[0] for sk in skeletons):
        raise NotComposable("the samples' features differ: " + "; ".join(", ".join(s.features) for s in steps))
    return steps[0].features, [[int(v) for f in s.features for v in re.findall(r"\d+", f)] for s in steps]


def _evaluate_phase(phase: str, samples: dict[int, tuple[StepTrace, dict[str, _Phase]]],
                    kinds: _Kinds) -> PhaseEstimate:
    """The phase's peak at the full depth: every allocation evaluated, the largest kept (the earliest of equals)."""
    depths = sorted(samples)
    data = {d: samples[d][1][phase] for d in depths}
    candidates = _outside_candidates(phase, data, depths, kinds)
    # each zone of the layers, kind by kind
    layer_name = _layer_namer(samples[depths[0]][0].layers)
    for zone in _ZONES:
        for kind in sorted(set(kinds.real[zone])):
            candidates += _zone_candidates(phase, zone, kind, samples, data, kinds, layer_name)
    return _highest(phase, candidates)


def _entered(after: int, depth: int, n: int) -> int:
    """Layers entered before an allocation, at the full depth ``n``, from ``after`` at a sample's ``depth``."""
    return 0 if after == 0 else n if after == depth else after


def _outside_candidates(phase: str, data: dict[int, _Phase], depths: list[int], kinds: _Kinds) -> list[tuple]:
    """The allocations of no layer at the full depth: each one's row, place in time and running module."""
    n = len(kinds.real_layers)
    d0 = depths[0]
    first = data[d0]
    if len({len(data[d].none.sizes) for d in depths}) != 1:
        raise NotComposable(f"{phase}: the samples allocate outside the layers {len(first.none.sizes)} and "
                            f"{len(data[depths[-1]].none.sizes)} times")
    Y = np.stack([data[d].none.values.reshape(-1) for d in depths])
    none = _Affine([_outside_features(kinds.sample_layers[d], kinds.n) for d in depths], Y,
                   f"{phase} outside the layers").predict([_outside_features(kinds.real_layers, kinds.n)])[0]
    return [(row, (2 * _entered(first.none.after[i], d0, n), first.none.order[i], 0), first.none.names[i])
            for i, row in enumerate(none.reshape(-1, _WIDTH))]


def _zone_candidates(phase: str, zone: str, kind: int, samples: dict[int, tuple[StepTrace, dict[str, _Phase]]],
                     data: dict[int, _Phase], kinds: _Kinds, layer_name: Callable[[int], str]) -> list[tuple]:
    """The highest allocation of ``zone`` in each layer of ``kind`` at the full depth: its row, place in time and
    running module."""
    n = len(kinds.real_layers)
    real_kinds = kinds.real[zone]
    instances = [(d, j) for d in sorted(samples) for j in range(d) if kinds.sample[(zone, d, j)] == kind]
    da, ja = instances[0]
    if not data[da].zones[(zone, ja)].sizes:
        return []
    Y = np.stack([data[d].zones[(zone, j)].values.reshape(-1) for d, j in instances])
    fit = _Affine([_layer_features(kinds.sample_layers[d], j, kinds.n) for d, j in instances], Y,
                  f"{phase} in the {zone} zone of layers of kind {kind}")
    at = [j for j in range(n) if real_kinds[j] == kind]
    values = fit.predict([_layer_features(kinds.real_layers, j, kinds.n) for j in at])
    rows0 = data[da].zones[(zone, ja)]
    old = samples[da][0].layers[ja]
    candidates = []
    for j, flat in zip(at, values, strict=True):
        rows = flat.reshape(-1, _WIDTH)
        k = int(np.argmax(rows[:, 0]))  # the first allocation at the zone's highest point
        rank = j if data[da].ascending else n - 1 - j
        candidates.append((rows[k], _when(zone, rows0, k, rank, da, n), _rename(rows0.names[k], old, layer_name(j))))
    return candidates


def _when(zone: str, rows0: _Rows, k: int, rank: int, depth: int, n: int) -> tuple[int, int, int]:
    """The place in time of allocation ``k`` of a layer's zone (``rank``-th layer run; ``rows0``: a sample's)."""
    # in time: the layer's own slot between the allocations of no layer; the outside zone's at its place
    if zone == "layer":
        return 2 * rank + 1, k, 0
    return 2 * _entered(rows0.after[k], depth, n), rows0.order[k], rank


def _highest(phase: str, candidates: list[tuple]) -> PhaseEstimate:
    """The phase's estimate at the largest of ``candidates`` (the earliest of equals)."""
    best = max(candidates, key=lambda c: (int(c[0][0]), tuple(-t for t in c[1])))
    row = [int(v) for v in best[0]]
    return PhaseEstimate(phase, row[0], *row[1:], best[2])


def _layer_namer(sample_layers: list[str]) -> Callable[[int], str]:
    """The name of layer ``j`` of the full model, from a sample's layer names (``model.layers.0``, ...)."""
    prefix = sample_layers[0].rsplit(".", 1)[0] + "." if "." in sample_layers[0] else ""
    return lambda j: f"{prefix}{j}"


def _rename(name: str, old: str, new: str) -> str:
    """``name`` (a module running in layer ``old``) as it reads in layer ``new``."""
    if name == old or name.startswith((old + ".", old + " ")):
        return new + name[len(old):]
    return name
