"""``memkit estimate --budget``: the cheapest feature plans whose predicted training peak fits a memory budget.

A :class:`Plan` is one choice on each axis: precision, quantization mode (only when the run already trains
LoRA adapters on a quantized model: the LoRA rank is kept, and a full fine-tune is never turned into a LoRA
one), activation checkpointing (none, selective, full), fused cross-entropy, micro-batch size (the batch
split into gradient-accumulation steps) and, when no single-device plan fits a Hugging Face config, pipeline
stages. Every candidate is estimated with :func:`~lightning_memkit.memory.estimate_training_memory` (its
real step on fake tensors); a candidate weaker than or equal on every axis to one that does not fit is
skipped without being estimated (each axis only lowers the peak). A plan fits when its predicted peak, plus
``margin`` of it (the estimator's accuracy goal, 5%), is within the budget.

**Step time model** (a prediction, used for ranking): a step costs its matmul and attention FLOPs (counted by
:class:`torch.utils.flop_counter.FlopCounterMode` on the fake step, recomputation included) plus
:data:`MACHINE_BALANCE` FLOPs per byte for twice the bytes its other operators write (one write, one read);
the ratio is a GPU's (H100 SXM: about 989 dense bf16 TFLOP/s over 3.35 TB/s of memory bandwidth). A plan's
overhead is its steps' cost over the given run's, minus one; a pipeline of ``S`` stages and ``M``
microbatches divides the cost by ``S`` and adds the 1F1B bubble ``(S - 1) / M``. Not modeled: slower small
GEMMs after a micro-batch split, kernel launch costs, communication.

Example (a one-layer tiny Llama: plans for half of its plain peak, four estimates at most)::

    >>> import pathlib, tempfile
    >>> from lightning_memkit.demo.hf_models import tiny_hf_config
    >>> from lightning_memkit.estimate.plans import HFRun, search_plans
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "config.json"
    >>> _ = path.write_text(tiny_hf_config("llama", vocab_size=1000, num_layers=1).to_json_string())
    >>> run = HFRun(path, seq_len=64, batch_size=2)
    >>> result = search_plans(run, budget_bytes=run.estimate(run.base).peak_bytes // 2, max_estimates=4)
    >>> best = result.fitting[0]
    >>> best.peak_bytes * 1.05 <= result.budget_bytes, "trainer:" in best.yaml()
    (True, True)
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_memkit.common.sizes import parse_bytes
from lightning_memkit.estimate.step import MemoryEstimate
from lightning_memkit.measure.storage import format_bytes

__all__ = ["Plan", "PlanResult", "SearchResult", "HFRun", "ConfigRun", "search_plans", "parse_bytes",
           "MACHINE_BALANCE"]

MACHINE_BALANCE = 300  # FLOPs per byte of memory traffic (H100 SXM: ~989 TFLOP/s bf16 / 3.35 TB/s)
_CHECKPOINT_STRENGTH = {None: 0, "selective": 1, "full": 2}
_PRECISION_STRENGTH = {"32-true": 0, "32": 0, "bf16-mixed": 0, "bf16-true": 1, "16-true": 1}
_PLUGIN_STRENGTH = {None: 0, "int8-lora": 0, "nf4-lora": 1, "fp4-lora": 1, "nf4-dq-lora": 2, "fp4-dq-lora": 2}


@dataclass(frozen=True)
class Plan:
    """One choice per axis; ``micro_batch`` sequences per forward (the batch is accumulated over the rest)."""

    precision: str
    plugin: str | None
    checkpoint: str | None
    fused_loss: bool
    micro_batch: int
    stages: int = 1

    def strength(self) -> tuple[int, ...]:
        """Per axis, how much the choice lowers memory (larger: more); micro-batch as minus its size."""
        return (_PRECISION_STRENGTH.get(self.precision, 0), _PLUGIN_STRENGTH.get(self.plugin, 0),
                _CHECKPOINT_STRENGTH[self.checkpoint], int(self.fused_loss), -self.micro_batch, self.stages)

    def at_most(self, other: Plan) -> bool:
        """Whether every axis of this plan lowers memory no more than ``other``'s does."""
        return all(a <= b for a, b in zip(self.strength(), other.strength(), strict=True))

    def describe(self, base: Plan) -> str:
        """What this plan changes from ``base``, in words."""
        words = []
        if self.precision != base.precision:
            words.append(f"precision {self.precision}")
        if self.plugin != base.plugin:
            words.append(f"quantization {self.plugin}")
        if self.checkpoint != base.checkpoint:
            words.append(f"{self.checkpoint or 'no'} activation checkpointing")
        if self.fused_loss != base.fused_loss:
            words.append("fused loss" if self.fused_loss else "no fused loss")
        if self.micro_batch != base.micro_batch:
            words.append(f"micro-batch {self.micro_batch} x {-(-base.micro_batch // self.micro_batch)} accumulation")
        if self.stages > 1:
            words.append(f"{self.stages} pipeline stages")
        return ", ".join(words) or "the run as given"


def step_cost(est: MemoryEstimate) -> float:
    """The step time model (module doc), in FLOP-equivalents."""
    return est.step_flops + 2 * MACHINE_BALANCE * est.step_bytes


@dataclass
class PlanResult:
    """A plan, its predicted peak (per rank with pipeline stages) and step time overhead, and its YAML."""

    plan: Plan
    peak_bytes: int
    overhead: float
    fits: bool
    run: Any = field(repr=False, default=None)

    def yaml(self) -> str:
        """A LightningCLI YAML fragment to pass after the run's own config (``--config base.yaml --config this``)."""
        import yaml

        head = (f"# {self.plan.describe(self.run.base)}: predicted peak {format_bytes(self.peak_bytes)}"
                f"{' per rank' if self.plan.stages > 1 else ''}, step time {self.overhead:+.0%} (predicted)\n")
        notes = "".join(f"# {n}\n" for n in self.run.notes(self.plan))
        return head + notes + yaml.safe_dump(self.run.fragment(self.plan), sort_keys=False)


@dataclass
class SearchResult:
    """Every plan estimated, the fitting ones cheapest first, and the counts of the search."""

    budget_bytes: int
    margin: float
    base: PlanResult
    fitting: list[PlanResult]
    estimated: int
    skipped: int
    capped: int = 0
    seconds: float = 0.0

    def to_json(self) -> str:
        import json

        def row(r: PlanResult) -> dict[str, Any]:
            return {"plan": r.plan.describe(self.base.plan), "peak_bytes": r.peak_bytes,
                    "overhead": round(r.overhead, 4), "yaml": r.yaml(), **r.plan.__dict__}

        return json.dumps({"budget_bytes": self.budget_bytes, "margin": self.margin, "base": row(self.base),
                           "plans": [row(r) for r in self.fitting], "estimated": self.estimated,
                           "skipped": self.skipped, "not_estimated_max_estimates": self.capped,
                           "seconds": round(self.seconds, 1)}, indent=2)

    def __str__(self) -> str:
        lines = [f"budget {format_bytes(self.budget_bytes)} ({self.budget_bytes:,} B), {self.margin:.0%} margin; "
                 f"the run as given peaks at {format_bytes(self.base.peak_bytes)} "
                 f"({'fits' if self.base.fits else 'does not fit'})",
                 f"{self.estimated} plans estimated, {self.skipped} ruled out without an estimate"
                 + (f", {self.capped} left out by the estimate limit (raise --max-estimates)" if self.capped else "")
                 + f"; searched in {self.seconds:.1f} s"]
        if not self.fitting:
            lines.append("no plan fits: a larger budget, a shorter sequence or more pipeline stages is needed")
        for i, r in enumerate(self.fitting, 1):
            lines += ["", f"plan {i}:", r.yaml().rstrip()]
        return "\n".join(lines)


# -- the two kinds of run ---------------------------------------------------------------------------------------
def batch_splits(batch_size: int) -> list[int]:
    """Micro-batch sizes to try: ``batch_size`` halved while it divides evenly."""
    sizes = [batch_size]
    while sizes[-1] % 2 == 0:
        sizes.append(sizes[-1] // 2)
    return sizes


def stronger_precisions(precision: str) -> list[str]:
    return [precision] + (["bf16-true"] if _PRECISION_STRENGTH.get(precision, 0) == 0 else [])


def stronger_checkpoints(checkpoint: str | None) -> list[str | None]:
    return [c for c in _CHECKPOINT_STRENGTH if _CHECKPOINT_STRENGTH[c] >= _CHECKPOINT_STRENGTH[checkpoint]]


def _stronger_plugins(plugin: str | None) -> list[str | None]:
    if plugin is None:
        return [None]
    return [plugin] + [p for p in ("nf4-lora", "nf4-dq-lora") if _PLUGIN_STRENGTH[p] > _PLUGIN_STRENGTH[plugin]]


class HFRun:
    """A causal LM from an HF ``config.json`` as ``memkit estimate --hf-config`` runs it; ``base`` is that run."""

    def __init__(self, path: str | Path, seq_len: int = 2048, batch_size: int = 1, precision: str = "32-true",
                 optimizer: str = "adamw", activation_checkpointing: bool | str = False, fused_loss: bool = False,
                 plugin: str | None = None, lora_rank: int = 16, device: str = "cuda"):
        from lightning_memkit.estimate.hf import checkpoint_mode
        from lightning_memkit.estimate.inputs import check_positions, check_tokens, read_hf_config

        seq_len, batch_size = check_tokens(seq_len, batch_size)
        self.config = read_hf_config(path)  # checked before the first estimate
        check_positions(seq_len, self.config, path)
        self.path, self.seq_len, self.optimizer, self.lora_rank = Path(path), seq_len, optimizer, lora_rank
        self.device = device
        self.batch_size = batch_size
        self.base = Plan(precision, plugin, checkpoint_mode(activation_checkpointing), bool(fused_loss), batch_size)

    def axes(self) -> Iterator[Plan]:
        b = self.base
        for values in itertools.product(stronger_precisions(b.precision), _stronger_plugins(b.plugin),
                                        stronger_checkpoints(b.checkpoint), sorted({b.fused_loss, True}),
                                        batch_splits(b.micro_batch)):
            yield Plan(*values)

    def estimate(self, plan: Plan) -> Any:
        from lightning_memkit.estimate.hf import estimate_from_hf_config, estimate_hf_pipeline

        kwargs = dict(seq_len=self.seq_len, precision=plan.precision, optimizer=self.optimizer,
                      activation_checkpointing=plan.checkpoint or False, fused_loss=plan.fused_loss)
        if plan.stages > 1:
            return estimate_hf_pipeline(self.path, plan.stages, microbatches=self.batch_size,
                                        batch_size=self.batch_size, **kwargs)
        return estimate_from_hf_config(self.path, batch_size=plan.micro_batch, plugin=plan.plugin,
                                       lora_rank=self.lora_rank, accumulate=plan.micro_batch < self.batch_size,
                                       device=self.device, **kwargs)

    def pipelines(self) -> Iterator[Plan]:
        """Pipeline plans with every single-device feature on (no quantization: not estimated with stages), for the
        models ``memkit_pipeline`` splits (``causal_lm_config_problems`` finds nothing)."""
        from lightning_memkit.hf.pipeline_stages import causal_lm_config_problems

        if self.base.plugin is None and not causal_lm_config_problems(self.config):
            layers = int(getattr(self.config, "num_hidden_layers", 0) or 0)
            for stages in [s for s in (2, 4, 8) if s <= layers]:
                yield Plan(stronger_precisions(self.base.precision)[-1], None, "full", True, self.batch_size, stages)

    def fragment(self, plan: Plan) -> dict[str, Any]:
        trainer: dict[str, Any] = {}
        if plan.plugin is not None:
            trainer["plugins"] = [_plugin_entry(plan, self.lora_rank)]
        elif plan.precision != "32-true":
            trainer["precision"] = plan.precision
        if plan.micro_batch != self.batch_size:
            trainer["accumulate_grad_batches"] = self.batch_size // plan.micro_batch
        if plan.stages > 1:
            trainer["devices"] = plan.stages
            trainer["strategy"] = {"class_path": "lightning_memkit.strategies.MemkitPipelineStrategy",
                                   "init_args": {"schedule": "1f1b", "microbatches": self.batch_size,
                                                 "partition": "memory", "fused_loss": plan.fused_loss}}
        callbacks = feature_callbacks(plan, fused_callback=plan.stages == 1)
        if callbacks:
            trainer["callbacks"] = callbacks
        return {"trainer": trainer}

    def notes(self, plan: Plan) -> list[str]:
        notes = ["add these callbacks to your own list (a later --config replaces the whole list)"
                 if feature_callbacks(plan, fused_callback=plan.stages == 1) else "a fragment of your trainer config"]
        if plan.micro_batch != self.batch_size:
            notes.append(f"and set your data module's batch size to {plan.micro_batch}")
        return notes


class ConfigRun:
    """A memkit / LightningCLI config as ``memkit estimate --config`` runs it; plans edit its parsed keys."""

    def __init__(self, config: str | Path, overrides: list[str] | tuple[str, ...] = ()):
        from lightning_memkit.common.errors import ConfigError
        from lightning_memkit.config.lightning_cli import parse_config
        from lightning_memkit.estimate.config import config_features as config_features

        self.config = Path(config)
        if not self.config.is_file():
            raise ConfigError(f"--config: no such file: {self.config}")
        self.parsed = parse_config(self.config, [str(a) for a in overrides])
        trainer = self.parsed.get("trainer") or {}
        features = config_features(trainer)
        self.batch_size = int(((self.parsed.get("data") or {}).get("init_args") or {}).get("batch_size") or 0)
        self.accumulate = int(trainer.get("accumulate_grad_batches") or 1)
        plugin = features["plugin"]
        self.plugin_entry = (trainer.get("plugins") or [None])[0] if plugin is not None else None
        self.base = Plan(features["precision"], None if plugin is None else f"{plugin.mode}-lora",
                         features["checkpoint"], features["fused"], self.batch_size)
        self.lora_rank = getattr(plugin, "lora_rank", 0)
        self.hf = _has_hf_model(self.parsed["model"])

    def axes(self) -> Iterator[Plan]:
        b = self.base
        precisions = [b.precision] if b.plugin is not None else stronger_precisions(b.precision)
        fused = sorted({b.fused_loss, self.hf})
        for values in itertools.product(precisions, _stronger_plugins(b.plugin), stronger_checkpoints(b.checkpoint),
                                        fused, batch_splits(b.micro_batch) if b.micro_batch else [0]):
            yield Plan(*values)

    def pipelines(self) -> Iterator[Plan]:
        return iter(())

    def edited(self, plan: Plan) -> dict[str, Any]:
        """The parsed config with ``plan`` applied."""
        parsed = copy.deepcopy(self.parsed)
        trainer = parsed.setdefault("trainer", {})

        from lightning_memkit.common.class_paths import class_name

        own = ("ActivationCheckpointing", "FusedLinearCrossEntropy")
        callbacks = trainer.get("callbacks") or []
        kept = [c for c in callbacks if class_name(c) not in own]
        given = {class_name(c): c for c in callbacks if class_name(c) in own}
        trainer["callbacks"] = kept + [_keep_settings(entry, given.get(class_name(entry)))
                                       for entry in feature_callbacks(plan, fused_callback=True)]
        if plan.plugin is not None:
            entry = copy.deepcopy(self.plugin_entry)
            entry.setdefault("init_args", {})["mode"] = plan.plugin.removesuffix("-lora")
            trainer["plugins"] = [entry]
        else:
            trainer["precision"] = plan.precision
        if plan.micro_batch != self.batch_size:
            parsed["data"]["init_args"]["batch_size"] = plan.micro_batch
            trainer["accumulate_grad_batches"] = self.accumulate * (self.batch_size // plan.micro_batch)
        return parsed

    def estimate(self, plan: Plan) -> MemoryEstimate:
        from lightning_memkit.estimate.config import estimate_parsed_config

        return estimate_parsed_config(self.edited(plan))

    def fragment(self, plan: Plan) -> dict[str, Any]:
        edited, out = self.edited(plan), {}
        for section in ("trainer", "data"):
            old, new = self.parsed.get(section) or {}, edited.get(section) or {}
            changed = {k: v for k, v in new.items() if old.get(k) != v}
            if section == "data" and changed:
                changed = {"init_args": {"batch_size": plan.micro_batch}}
            if changed:
                out[section] = changed
        return out

    def notes(self, plan: Plan) -> list[str]:
        return [f"memkit fit --config {self.config} --config this.yaml"]


def _has_hf_model(model_entry: dict[str, Any]) -> bool:
    """Whether the config's model has a causal LM the ``FusedLinearCrossEntropy`` callback can patch (its
    ``find_causal_lms``), built on fake tensors."""
    from lightning_memkit.config.lightning_cli import instantiate
    from lightning_memkit.estimate.trace import fake_tensors
    from lightning_memkit.hf.fused_loss import find_causal_lms

    with fake_tensors():
        model = instantiate(model_entry)
    try:
        return bool(find_causal_lms(model))
    except (ValueError, ImportError):
        return False


def _keep_settings(entry: dict[str, Any], given: Any) -> Any:
    """A plan's callback ``entry`` with the settings of the config's own entry of that callback (``given``) kept:
    its other init args (``policy``, ``budget_bytes``...) stay as the config sets them, the plan's replace theirs."""
    if not isinstance(given, dict):
        return entry
    out = copy.deepcopy(given)
    args = {**(out.get("init_args") or {}), **entry.get("init_args", {})}
    if args:
        out["init_args"] = args
    return out


def feature_callbacks(plan: Plan, fused_callback: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if plan.checkpoint is not None:
        out.append({"class_path": "lightning_memkit.callbacks.ActivationCheckpointing",
                    "init_args": {"selective": plan.checkpoint == "selective"}})
    if plan.fused_loss and fused_callback:
        out.append({"class_path": "lightning_memkit.callbacks.FusedLinearCrossEntropy"})
    return out


def _plugin_entry(plan: Plan, lora_rank: int) -> dict[str, Any]:
    from lightning_memkit.estimate.hf import plugin_dtype

    dtype = str(plugin_dtype(plan.precision)).removeprefix("torch.")
    return {"class_path": "lightning_memkit.plugins.NoSaveBitsandbytesPrecision",
            "init_args": {"mode": plan.plugin.removesuffix("-lora"), "dtype": dtype, "lora_rank": lora_rank}}


# -- the search --------------------------------------------------------------------------------------------------
def _pipeline_factor(plan: Plan, microbatches: int) -> float:
    return (1 + (plan.stages - 1) / microbatches) / plan.stages


def _search_order(plan: Plan, base: Plan) -> tuple[float, int]:
    """Least added work first (recomputation, accumulation steps, quantization work); then the choices that
    lower memory without adding work (precision, fused loss) strongest first, so that one that does not fit
    rules out the weaker ones and one that fits rules out the costlier ones."""
    s = plan.strength()
    steps = math.log2(max(base.micro_batch, 1) / max(plan.micro_batch, 1))
    return s[1] + s[2] + steps, -(s[0] + s[3])


def _strongest(plans: list[Plan]) -> Plan:
    """The plan every other one is at most (each axis at its strongest); the candidates are a full product."""
    best = max(plans, key=lambda p: p.strength())
    if not all(p.at_most(best) for p in plans):
        raise AssertionError(f"no strongest plan among {len(plans)} candidates")  # axes() yields a product
    return best


def _probes(top: Plan, plans: list[Plan]) -> list[Plan]:
    """Per axis with a weaker choice, the strongest plan ``top`` with that axis one step weaker. Estimated right
    after ``top`` when it fits and the run as given does not: a probe that does not fit rules out every plan at
    most as strong on that axis (all other axes are at most ``top``'s), a face of the plans at one estimate; under a
    tight budget most of the plans go that way. A probe that fits is a plan like any other."""
    strongest = top.strength()
    best: dict[int, Plan] = {}
    for plan in plans:
        strength = plan.strength()
        axes = [i for i, (a, b) in enumerate(zip(strength, strongest, strict=True)) if a != b]
        if len(axes) == 1 and strength[axes[0]] < strongest[axes[0]]:
            i = axes[0]
            if i not in best or strength[i] > best[i].strength()[i]:
                best[i] = plan
    return [best[i] for i in sorted(best)]


def _costlier(plan: Plan, cheaper: Plan) -> bool:
    """Whether ``plan`` only adds recomputation, accumulation steps or quantization work to ``cheaper`` (same
    precision and loss): it then costs at least as much in the time model, so a fitting ``cheaper`` rules it out."""
    return (plan != cheaper and cheaper.at_most(plan) and plan.precision == cheaper.precision
            and plan.fused_loss == cheaper.fused_loss and plan.stages == cheaper.stages)


@dataclass
class _Search:
    """The state of one :func:`search_plans`."""

    run: Any
    fits: Callable[[int], bool]
    say: Callable[[str], None]
    max_estimates: int
    fitting: list[PlanResult] = field(default_factory=list)
    failed: list[Plan] = field(default_factory=list)
    estimated: int = 0
    skipped: int = 0
    capped: int = 0  # plans left out by max_estimates
    base_cost: float = 0.0
    queue: list[Plan] = field(default_factory=list)  # the plans still to try, in order (for the progress line)
    done: set[Plan] = field(default_factory=set)  # the plans tried (estimated or ruled out)
    start: float = field(default_factory=time.perf_counter)

    def ruled_out(self, plan: Plan) -> bool:
        return any(plan.at_most(f) for f in self.failed) or any(_costlier(plan, r.plan) for r in self.fitting)

    def try_plan(self, plan: Plan, single_cost: float | None = None) -> tuple[PlanResult, float] | None:
        """Estimate ``plan`` unless a known result rules it out; file it as fitting or failed."""
        if plan in self.queue:
            self.queue.remove(plan)
        if plan in self.done:
            return None
        self.done.add(plan)
        if self.ruled_out(plan):
            self.skipped += 1
            return None
        if self.estimated >= self.max_estimates:
            self.capped += 1
            return None
        self.say(self._progress(plan))
        est = self.run.estimate(plan)
        self.estimated += 1
        if plan.stages > 1:  # the single-device step of the same features, split over the stages
            cost = single_cost * _pipeline_factor(plan, self.run.batch_size)
        else:
            cost = step_cost(est) * -(-max(self.run.base.micro_batch, 1) // max(plan.micro_batch, 1))
        self.base_cost = self.base_cost or cost
        result = PlanResult(plan, est.peak_bytes, cost / self.base_cost - 1, self.fits(est.peak_bytes), self.run)
        if result.fits:
            self.fitting.append(result)
        else:
            self.failed.append(plan)
        return result, cost

    def _progress(self, plan: Plan) -> str:
        """``estimate 3/12: <plan> (40 s so far, about 2 min left)``: the estimates done and planned (this one, and
        those still queued that no result rules out yet: the count can only fall), and the time left at the mean
        time of the estimates so far."""
        planned = self.estimated + 1 + sum(not self.ruled_out(p) for p in self.queue)
        planned = min(planned, self.max_estimates)
        line = f"estimate {self.estimated + 1}/{planned}: {plan.describe(self.run.base)}"
        if self.estimated:
            elapsed = time.perf_counter() - self.start
            left = elapsed / self.estimated * (planned - self.estimated)
            line += f" ({_duration(elapsed)} so far, about {_duration(left)} left)"
        return line


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def search_plans(run: HFRun | ConfigRun, budget_bytes: int, margin: float = 0.05, max_plans: int = 3,
                 max_estimates: int = 48, progress: Callable[[str], None] | None = None) -> SearchResult:
    """Estimate the candidate plans of ``run`` and return those that fit ``budget_bytes``, cheapest first.

    The run as given and the strongest plan come first (if that one does not fit, no single-device plan does);
    when only the strongest fits, it is probed with each axis one step weaker (a probe that does not fit rules
    out that face of the plans); then the rest, least added work first, skipping a plan weaker than one that
    does not fit, or one that only adds work to one that fits. The cheapest fitting plan is always found (plan
    1); the others listed are fitting plans found on the way, cheapest first.

    Args:
        run: :class:`HFRun` or :class:`ConfigRun`; its ``base`` plan is the run as given.
        budget_bytes: device memory available to training (per rank with pipeline stages).
        margin: a plan fits when ``peak * (1 + margin) <= budget_bytes``.
        max_plans: how many fitting plans to return.
        max_estimates: stop after this many estimates.
        progress: called with a line before each estimate: the estimates done and planned, the time so far and the
            time left (``estimate 3/12: <plan> (40 s so far, about 2 min left)``).
    """
    from lightning_memkit.common.validation import check_int

    check_int(budget_bytes, "budget_bytes", minimum=1, owner="search_plans")
    check_int(max_plans, "max_plans", minimum=1, owner="search_plans")
    check_int(max_estimates, "max_estimates", minimum=1, owner="search_plans")
    if not 0 <= margin < 1:
        raise ValueError(f"search_plans(margin=...) must be in [0, 1), got {margin!r}")
    search = _Search(run, lambda peak: peak * (1 + margin) <= budget_bytes, progress or (lambda _line: None),
                     max_estimates)
    ordered = sorted((p for p in run.axes() if p != run.base), key=lambda p: _search_order(p, run.base))
    top = _strongest([run.base, *ordered])
    search.queue = [top, *(p for p in ordered if p != top)]
    base, base_cost = search.try_plan(run.base)
    strongest = (base, base_cost) if top == run.base else search.try_plan(top)
    if strongest is None or strongest[0].fits:  # None: ruled out by a fitting base (only adds work) or the limit
        probes = _probes(top, ordered) if strongest is not None and not base.fits else []
        rest = [p for p in ordered if p != top and p not in probes]
        search.queue = [*probes, *rest]
        for plan in [*probes, *rest]:
            search.try_plan(plan)
    else:
        search.skipped += len(ordered) - (top != run.base)  # each is weaker than the strongest, which does not fit
        search.queue = list(run.pipelines())
        for plan in list(search.queue):
            if (found := search.try_plan(plan, strongest[1])) is not None and found[0].fits:
                break
    fitting = sorted(search.fitting, key=lambda r: (r.plan.stages, r.overhead, -sum(r.plan.strength())))
    return SearchResult(budget_bytes, margin, base, fitting[:max_plans], search.estimated, search.skipped,
                        search.capped, time.perf_counter() - search.start)
