"""The ``tiled_mlp`` lever: each decoder layer's MLP computed in tiles of tokens (:class:`~lightning_memkit.callbacks.
TiledMLP`, tiles of the model's hidden size), its ``tokens x intermediate`` activations never whole; the same math.
Its cost is the MLP's forward once more in backward (each tile recomputed), which the fake step's traced FLOPs
carry. Opt-in: named in ``allow`` (``memkit estimate --allow tiled_mlp``, ``MemoryBudget(allow=[...])``).

    >>> from lightning_memkit.estimate.levers.tiled_mlp import TILED_MLP
    >>> TILED_MLP.words(True, False), TILED_MLP.entry()
    ('tiled MLP', {'class_path': 'lightning_memkit.callbacks.TiledMLP'})
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning_memkit.estimate.levers.base import StepSpec
from lightning_memkit.estimate.levers.switch import SwitchLever

__all__ = ["TILED_MLP", "TiledMLPLever", "tiled_mlps_inside"]


@contextlib.contextmanager
def tiled_mlps_inside(module: Any) -> Iterator[None]:
    """The fake step's tiled MLPs: :func:`~lightning_memkit.recompute.tiled_mlp.tiled_mlps` on ``module`` in tiles of
    its hidden size, as the ``TiledMLP`` callback's ``"auto"``."""
    from lightning_memkit.recompute.tiled_mlp import default_tile_tokens, tiled_mlps

    with tiled_mlps(module, default_tile_tokens(module)):
        yield


class TiledMLPLever(SwitchLever):
    name, kind, keeps_math, opt_in = "tiled_mlp", "work", True, True
    callback = "lightning_memkit.callbacks.TiledMLP"
    label = "tiled MLP"
    runs_sharded = False  # not checked inside FSDP2 units yet

    def to_step(self, choice: Any, spec: StepSpec) -> None:
        if choice:
            spec.patches.append(tiled_mlps_inside)


TILED_MLP = TiledMLPLever()
