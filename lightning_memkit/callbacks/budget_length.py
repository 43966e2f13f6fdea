"""The length ``MemoryBudget`` trains at when the data module leaves it open (``TextDataModule(max_length="auto")``):
the longest whose strongest plan fits the budget (:func:`~lightning_memkit.estimate.longest.longest_sequence` on the
module as it is), at most what the data allows and the model's positions; chosen once, by one rank for all, and read
back from the checkpoint on a resume (the rows must be cut as before, or the loader's position means other data).

A data module opts in with two methods: ``auto_length_limit()`` (the most tokens per row it allows while its length
is open, else ``None``) and ``batch_at(tokens)`` (a batch of that length to plan on), then ``set_max_length(tokens)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["choose_length", "model_positions"]


def model_positions(module: Any) -> int | None:
    """The positions ``module``'s model is built for: the first ``config.max_position_embeddings`` among its
    modules (``None``: none says)."""
    from lightning_memkit.estimate.longest import config_positions

    return next((n for m in module.modules() if (n := config_positions(getattr(m, "config", None)))), None)


def choose_length(trainer: Any, pl_module: Any, make_run: Callable[[Any], Any], budget_bytes: int, margin: float,
                  saved: Callable[[], int | None], say: Callable[[str], None], owner: str) -> int | None:
    """The length the data module of ``trainer`` is cut to (set on it), or ``None`` where its length is fixed.
    ``make_run(batch)``: the run of a planning batch; ``saved()``: the length of the checkpoint resumed (read only
    where the length is open)."""
    from lightning_memkit.estimate.longest import longest_sequence
    from lightning_memkit.measure.storage import format_bytes

    data = trainer.datamodule
    limit = getattr(data, "auto_length_limit", lambda: None)()
    if limit is None:
        return None
    positions = model_positions(pl_module)
    most = min(limit, positions) if positions else limit
    resumed = saved()
    if resumed:
        data.set_max_length(int(resumed))
        say(f"{owner}: max_length='auto': {int(resumed):,} tokens per row, as the checkpoint's run chose")
        return int(resumed)
    tokens, why = None, None
    if trainer.global_rank == 0:
        step = 128 if most <= 16384 else 1024
        try:
            found = longest_sequence(lambda t: make_run(data.batch_at(t)), budget_bytes, lower=min(step, most),
                                     granularity=step, margin=margin, limit=most, plans=False)
            tokens = found.seq_len
        except ValueError as err:
            why = str(err)
    if trainer.world_size > 1:
        tokens, why = trainer.strategy.broadcast((tokens, why), src=0)
    if tokens is None:
        raise ValueError(f"{owner}: max_length='auto': {why}")
    data.set_max_length(tokens)
    bound = "the data's" if most == limit else "the model's max_position_embeddings"
    say(f"{owner}: max_length='auto': training at {tokens:,} tokens per row, the longest whose strongest plan fits "
        f"{format_bytes(budget_bytes)} with the {margin:.0%} margin ({bound} limit: {most:,})")
    return tokens
