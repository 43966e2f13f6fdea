"""The longest sequence that fits: ``memkit estimate --hf-config model.json --budget 24GiB --seq-len max``.

Every lever lowers memory, so if any plan fits at ``T`` tokens the strongest plans (each lever at its strongest,
:func:`~lightning_memkit.estimate.plans.search_plans`' first estimates) fit too, and a plan that fits at ``T``
fits at fewer tokens. :func:`longest_sequence` therefore probes the strongest plans only: at ``lower`` and twice it,
then where the line through the peaks of the last two lengths that fit meets the budget (rounded up to a multiple
of ``granularity``), until they stop fitting (or the config's ``max_position_embeddings`` is reached); then it
narrows the bracket to a multiple of ``granularity`` tokens where the line through the two bracketing peaks meets
the budget (a bisection step whenever that does not halve the bracket); at the longest ``T`` found, a full plan
search ranks the plans that fit by their predicted step time.

Example (a tiny Llama whose one-sequence step must fit 8 MiB; the lengths probed, then the longest)::

    >>> import pathlib, tempfile
    >>> from lightning_memkit.demo.hf_models import tiny_hf_config
    >>> from lightning_memkit.estimate.hf_run import HFRun
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "config.json"
    >>> _ = path.write_text(tiny_hf_config("llama", vocab_size=256, max_position_embeddings=4096).to_json_string())
    >>> found = longest_sequence(lambda t: HFRun(path, seq_len=t, allow=("recompute",), device="cpu"),
    ...                          8 * 2**20, lower=128, granularity=128)
    >>> [t for t, _, _ in found.probes], found.seq_len
    ([128, 256, 1152, 1024], 1024)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_memkit.common.validation import check_int

__all__ = ["LongestResult", "longest_sequence"]

_OWNER = "longest_sequence"


@dataclass
class LongestResult:
    """The longest ``seq_len`` that fits, the plan search at it, and every length probed (``(tokens, fits,
    strongest plans' smallest peak)``)."""

    seq_len: int
    search: Any
    probes: list[tuple[int, bool, int]] = field(default_factory=list)
    limit: int = 0  # the positions the model is built for (max_position_embeddings), 0: none
    seconds: float = 0.0

    def __str__(self) -> str:
        from lightning_memkit.measure.storage import format_bytes

        bound = " (the most tried: the positions or the data allow no more)" if self.seq_len == self.limit else ""
        lines = [f"longest sequence that fits: {self.seq_len:,} tokens{bound}; {len(self.probes)} lengths probed "
                 f"with the strongest plans, then the plans searched at it; {self.seconds:.1f} s"]
        if self.search is None:
            return lines[0]
        if self.search.fitting:
            best = self.search.fitting[0]
            on = f" on {self.search.machine}" if self.search.machine else ""
            lines.append(f"plan 1 at {self.seq_len:,} tokens: {best.plan.describe(self.search.base.plan)}; device "
                         f"{format_bytes(best.peak_bytes)}, host {format_bytes(best.host_bytes)}, step "
                         f"{best.step_seconds:.3g} s predicted{on}")
        return "\n".join([*lines, str(self.search)])

    def to_dict(self) -> dict[str, Any]:
        import json

        return {"seq_len": self.seq_len, "limit": self.limit, "seconds": round(self.seconds, 1),
                "probes": [{"seq_len": t, "fits": f, "peak_bytes": p} for t, f, p in self.probes],
                "search": None if self.search is None else json.loads(self.search.to_json())}


def longest_sequence(make_run: Callable[[int], Any], budget_bytes: int, *, lower: int = 1024,
                     granularity: int = 1024, margin: float = 0.05, host_budget: int | None = None,
                     machine: Any = None, progress: Callable[[str], None] | None = None, limit: int | None = None,
                     plans: bool = True, **search: Any) -> LongestResult:
    """The longest sequence (a multiple of ``granularity``, at least ``lower``, or ``limit``) whose step fits
    ``budget_bytes`` with some plan; ``make_run(seq_len)`` makes the run (an
    :class:`~lightning_memkit.estimate.hf_run.HFRun` at that length). ``limit``: the most tokens to try (default:
    the run's config's ``max_position_embeddings``, if any); ``plans=False``: no plan search at the length found
    (``search`` is then ``None``). ``margin``, ``host_budget``, ``machine`` and ``search`` (``max_plans``,
    ``max_estimates``) as :func:`~lightning_memkit.estimate.plans.search_plans`'.

    Raises:
        ValueError: a bad argument (one line naming it), or no plan fits even at ``lower`` tokens.
    """
    from lightning_memkit.estimate.plans import search_plans, strongest_fits
    from lightning_memkit.measure.device import free_device_memory

    check_int(lower, "lower", minimum=1, owner=_OWNER)
    check_int(granularity, "granularity", minimum=1, owner=_OWNER)
    if limit is not None:
        check_int(limit, "limit", minimum=1, owner=_OWNER)
        lower = min(lower, limit)
    say = progress or (lambda _line: None)
    start = time.perf_counter()
    if host_budget is None:  # read once: every length is judged against the same host memory
        host_budget = free_device_memory("cpu")
    runs = {lower: make_run(lower)}

    def run_at(tokens: int) -> Any:
        if tokens not in runs:
            runs[tokens] = make_run(tokens)
        return runs[tokens]

    limit = limit if limit is not None else _position_limit(runs[lower])
    probes: list[tuple[int, bool, int]] = []

    def fits(tokens: int) -> bool:
        ok, peak = strongest_fits(run_at(tokens), budget_bytes, margin=margin, host_budget=host_budget)
        probes.append((tokens, ok, peak))
        say(f"{tokens:,} tokens: the strongest plans {'fit' if ok else 'do not fit'} (peak {peak / 2**30:.2f} GiB)")
        return ok

    if not fits(lower):
        raise ValueError(f"--seq-len max: no plan fits {budget_bytes:,} B even at {lower:,} tokens")
    good, bad, target = lower, None, budget_bytes / (1 + margin)
    while bad is None and (limit is None or good < limit):
        tokens = _above(good, probes, target, granularity)
        tokens = tokens if limit is None else min(tokens, limit)
        if fits(tokens):
            good = tokens
        else:
            bad = tokens
    secant = True
    while bad is not None and bad - good > granularity:
        width = bad - good
        peaks = {t: p for t, _, p in probes}
        tokens = _between(good, bad, peaks, target, granularity, secant)
        if fits(tokens):
            good = tokens
        else:
            bad = tokens
        secant = bad - good <= width // 2  # a secant step that did not halve the bracket: bisect once
    if not plans:
        say(f"longest: {good:,} tokens")
        return LongestResult(good, None, probes, limit or 0, time.perf_counter() - start)
    say(f"longest: {good:,} tokens; searching its plans")
    result = search_plans(run_at(good), budget_bytes, margin=margin, host_budget=host_budget, machine=machine,
                          progress=progress, **search)
    return LongestResult(good, result, probes, limit or 0, time.perf_counter() - start)


def _above(good: int, probes: list[tuple[int, bool, int]], target: float, granularity: int) -> int:
    """The next length to probe above ``good``, the longest that fits so far: twice it until two lengths fit, then
    where the line through the peaks of the last two that fit meets ``target`` (a step's peak is nearly affine in
    its tokens), rounded up to a multiple of ``granularity``: the first length past the line's, which brackets the
    longest with ``good`` unless the peaks grow slower than the line; at least ``good + granularity``."""
    fitted = [(t, peak) for t, ok, peak in probes if ok]
    if len(fitted) < 2:
        return good * 2
    (t0, p0), (t1, p1) = fitted[-2], fitted[-1]
    if t1 <= t0 or p1 <= p0:  # no growth to extrapolate
        return good * 2
    line = t1 + (target - p1) * (t1 - t0) / (p1 - p0)
    return max(-(-int(line) // granularity) * granularity, good + granularity)


def _between(good: int, bad: int, peaks: dict[int, int], target: float, granularity: int, secant: bool) -> int:
    """The next length to probe inside ``(good, bad)``, a multiple of ``granularity``: where the line through the
    two lengths' peaks meets ``target`` (a step's peak is nearly affine in its tokens: a probe or two finds the
    length), else the middle."""
    low, high = good + granularity, bad - granularity
    middle = min(max((good + bad) // 2 // granularity * granularity, low), high)
    below, above = peaks.get(good, 0), peaks.get(bad, 0)
    if not secant or above <= below or low > high:
        return middle
    guess = int(good + (target - below) * (bad - good) / (above - below)) // granularity * granularity
    return min(max(guess, low), high)


def _position_limit(run: Any) -> int | None:
    return config_positions(getattr(run, "config", None))


def config_positions(config: Any) -> int | None:
    """``config.max_position_embeddings`` where it is a positive int (the positions a model is built for), else
    ``None``."""
    limit = getattr(config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None
