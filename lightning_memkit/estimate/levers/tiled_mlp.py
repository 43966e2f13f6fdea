"""The ``tiled_mlp`` lever: each decoder layer's MLP computed in tiles of tokens (:class:`~lightning_memkit.callbacks.
TiledMLP`), its ``tokens x intermediate`` activations never whole; the same math. A choice is the tile in tokens: four
times the model's hidden size or the hidden size (ALST's and Liger's default), the larger tried first (fewer, larger
matrix products: the least work), so a plan takes the larger tile where its budget allows. (A smaller tile lowers a
tile's intermediate below the MLP's weights, where the peak rarely is.) Its cost is the MLP's forward once more in
backward (each tile recomputed), which the fake step's FLOPs carry (one traced tile standing for the alike ones).
Opt-in: named in ``allow`` (``memkit estimate --allow tiled_mlp``, ``MemoryBudget(allow=[...])``).

    >>> from lightning_memkit.estimate.levers.tiled_mlp import TILED_MLP, tile_choices
    >>> tile_choices(4096, seq_len=100_000), tile_choices(64, seq_len=128)
    ([16384, 4096], [64])
    >>> TILED_MLP.words(4096, False), TILED_MLP.entry_for({"tiled_mlp": 4096})["init_args"]
    ('tiled MLP (4,096-token tiles)', {'tile_tokens': 4096})
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

from lightning_memkit.estimate.levers.base import StepSpec, TrainerEdit, find_callback
from lightning_memkit.estimate.levers.switch import SwitchLever

__all__ = ["TILED_MLP", "TiledMLPLever", "tile_choices", "tiled_mlps_inside"]

#: the tiles tried, as multiples of the hidden size: larger first
MULTIPLES = (4, 1)


def tile_choices(hidden: int, seq_len: int | None = None) -> list[int]:
    """The tiles (tokens) to try for a model of ``hidden`` size: :data:`MULTIPLES` of it, those shorter than a
    sequence of ``seq_len`` tokens (a tile as long as the sequence cuts nothing), at least the smallest."""
    tiles = sorted({max(int(hidden * m), 1) for m in MULTIPLES}, reverse=True)
    shorter = [t for t in tiles if seq_len is None or t < seq_len]
    return shorter or tiles[-1:]


def tiled_mlps_inside(module: Any, tile_tokens: int | str = "auto") -> contextlib.AbstractContextManager[None]:
    """The fake step's tiled MLPs: :func:`~lightning_memkit.recompute.tiled_mlp.tiled_mlps` on ``module`` in tiles of
    ``tile_tokens`` (``"auto"``: its hidden size, as the ``TiledMLP`` callback's default)."""
    return _tiled(module, tile_tokens)


@contextlib.contextmanager
def _tiled(module: Any, tile_tokens: int | str) -> Iterator[None]:
    from lightning_memkit.recompute.tiled_mlp import default_tile_tokens, tiled_mlps

    with tiled_mlps(module, default_tile_tokens(module) if tile_tokens == "auto" else tile_tokens):
        yield


def _patch(tile_tokens: int | str) -> Callable[[Any], contextlib.AbstractContextManager[None]]:
    return lambda module: tiled_mlps_inside(module, tile_tokens)


def _hidden(run: Any) -> int | None:
    """The hidden size of ``run``'s model: an HF run's config, a module run's module (``None``: not known)."""
    size = getattr(getattr(run, "config", None), "hidden_size", None)
    if isinstance(size, int) and size > 0:
        return size
    module = getattr(run, "module", None)
    if module is None:
        return None
    from lightning_memkit.recompute.tiled_mlp import default_tile_tokens

    return default_tile_tokens(module)


def _tokens(run: Any) -> int | None:
    """The tokens of ``run``'s sequences: an HF run's ``seq_len``, a module run's ``input_ids`` (else ``None``)."""
    tokens = getattr(run, "seq_len", None)
    if tokens is None and isinstance(getattr(run, "batch", None), dict):
        ids = run.batch.get("input_ids")
        tokens = int(ids.shape[-1]) if hasattr(ids, "shape") and len(ids.shape) >= 1 else None
    return tokens


class TiledMLPLever(SwitchLever):
    name, kind, keeps_math, opt_in = "tiled_mlp", "work", True, True
    callback = "lightning_memkit.callbacks.TiledMLP"
    label = "tiled MLP"

    def strength(self, choice: Any) -> int:
        """Off: 0; a tile: more the fewer its tokens (``"auto"``, the hidden size, between 4 and 1 times)."""
        if not choice:
            return 0
        return 1 + (2**40 // choice if isinstance(choice, int) else 0)

    def options(self, base: Any, run: Any) -> list[Any]:
        if not run.allows(self.name) or self.unavailable(run):
            return [base]
        hidden = _hidden(run)
        if hidden is None:  # a config run: the tile of the hidden size only
            return [base] if base else [False, "auto"]
        tiles = tile_choices(hidden, _tokens(run))
        if base:
            given = hidden if base == "auto" else base
            return [base, *(t for t in tiles if t < given)]
        return [False, *tiles]

    def work(self, choice: Any, base: Any) -> float:
        """One for tiling, a little more the smaller the tile (its matrix products smaller, more of them)."""
        if not choice or choice == base:
            return 0.0
        return 1.0 + (math.log2(2**20 / choice) / 32 if isinstance(choice, int) else 0.25)

    def words(self, choice: Any, base: Any) -> str:
        if not choice:
            return f"no {self.label}"
        return f"{self.label} ({choice:,}-token tiles)" if isinstance(choice, int) else self.label

    def entry_for(self, plan: Any) -> dict[str, Any]:
        tile = plan[self.name] if self.name in plan else "auto"
        return {"class_path": self.callback, "init_args": {"tile_tokens": "auto" if tile is True else tile}}

    def write_module(self, plan: Any, run: Any, out: Any) -> None:
        if plan[self.name] and plan[self.name] != run.base[self.name]:
            out.callbacks.append(self.entry_for(plan))

    def to_step(self, choice: Any, spec: StepSpec) -> None:
        if choice:
            spec.patches.append(_patch("auto" if choice is True else choice))

    def read_trainer(self, trainer: Any) -> Any:
        found = find_callback(trainer, self.callback)
        return False if found is None else found.tile_tokens

    def read_config(self, trainer: dict[str, Any]) -> Any:
        from lightning_memkit.common.class_paths import class_name

        for c in trainer.get("callbacks") or []:
            if class_name(c) == class_name(self.callback):
                return ((c.get("init_args") or {}) if isinstance(c, dict) else {}).get("tile_tokens", "auto")
        return False

    def apply(self, choice: Any, base: Any, edit: TrainerEdit) -> None:
        if not choice or choice == base:
            return
        found = edit.find(self.callback)
        if found is None:
            from lightning_memkit.common.class_paths import instantiate

            found = instantiate({"class_path": self.callback})
            edit.added.append(found)
        found.tile_tokens = "auto" if choice is True else choice
        edit.change(f"{self.words(choice, base)} ({self.callback.rpartition('.')[2]})")


TILED_MLP = TiledMLPLever()
