"""Tiled MLP: each decoder layer's MLP computed over a few tokens at a time, so that its intermediate activations
(``tokens x intermediate``: the gate and up projections, their product) never exist for the whole sequence, in
forward or in backward (as Arctic Long Sequence Training's and Liger-Kernel's ``TiledMLP`` do).

An MLP is row-wise: each token's output depends on that token's input only. :func:`tiled_mlps` makes each target
split its input rows into tiles of ``tile_tokens``, run each tile under a non-reentrant checkpoint (forward keeps
only the tile's input, a view of the whole input; backward recomputes one tile at a time) and write the tile's
output into one output tensor. The parameters' gradients are summed over the tiles by autograd (one
accumulation each, so DDP and FSDP2 hooks fire once).

Targets (:func:`mlp_targets`), per repeated block (a transformers model's decoder layers) with an ``mlp``:

- a dense MLP (``LlamaMLP``, ``Gemma3MLP``, a peft- or QLoRA-wrapped one): its input ``(..., hidden)`` tiled over
  every token of the batch;
- a mixture-of-experts block: its experts module (a child named ``*Experts``) tiled over the tokens it is given
  with their routing (every tensor argument's rows), and its shared experts (a child named ``*MLP``) as dense MLPs;
  the router still sees every token at once, so its logits (and the auxiliary loss made of them) are unchanged.

The math is the same: each row is computed by the same ops; only the matmuls' blocking and the order the tiles' weight
gradients are summed differ (bitwise equal outputs where the kernel's blocking does not depend on the row count;
within float32 rounding otherwise).

Example (a tiny Llama: the same loss in tiles of 16 tokens)::

    >>> import torch
    >>> from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
    >>> model = tiny_hf_causal_lm("llama", seed=0)
    >>> ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    >>> plain = model(input_ids=ids, labels=ids).loss
    >>> with tiled_mlps(model, tile_tokens=16) as targets:
    ...     tiled = model(input_ids=ids, labels=ids).loss
    >>> len(targets), torch.allclose(plain, tiled, rtol=1e-6, atol=1e-6)
    (2, True)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_memkit.common.validation import check_int

__all__ = ["default_tile_tokens", "mlp_targets", "tiled_forward", "tiled_mlps"]

_OWNER = "tiled_mlps"


def mlp_targets(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(name, module, kind)`` of the modules :func:`tiled_mlps` tiles: ``kind`` is ``"dense"`` (an MLP applied to
    every token) or ``"experts"`` (a mixture-of-experts block's experts, given the routed tokens as rows). Found
    under the ``mlp`` of each repeated block (a transformers model's decoder layers); an empty list where none has
    one."""
    from lightning_memkit.recompute.activation_recompute import repeated_blocks

    found = []
    for name, block in repeated_blocks(model):
        mlp = getattr(block, "mlp", None)
        if not isinstance(mlp, nn.Module):
            continue
        experts = [(n, c) for n, c in mlp.named_children() if type(c).__name__.endswith("Experts")]
        if not experts:
            found.append((f"{name}.mlp", mlp, "dense"))
            continue
        found += [(f"{name}.mlp.{n}", c, "experts") for n, c in experts]
        found += [(f"{name}.mlp.{n}", c, "dense") for n, c in mlp.named_children()
                  if type(c).__name__.endswith("MLP")]
    return found


def default_tile_tokens(model: nn.Module) -> int:
    """Tiles of as many tokens as the model's hidden size (a tile's intermediate then takes no more than the
    MLP's weight matrices, ALST's and Liger's default): its config's ``hidden_size``, else the first MLP's input
    width (a Linear's ``in_features``), else 1024."""
    for module in model.modules():
        size = getattr(getattr(module, "config", None), "hidden_size", None)
        if isinstance(size, int) and size > 0:
            return size
    for _, target, _ in mlp_targets(model):
        linear = next((m for m in target.modules() if isinstance(m, nn.Linear)), None)
        if linear is not None:
            return linear.in_features
    return 1024


def tiled_forward(forward: Callable[..., torch.Tensor], tile_tokens: int, kind: str,
                  module: nn.Module | None = None) -> Callable[..., torch.Tensor]:
    """``forward`` computed in tiles of ``tile_tokens`` rows (see the module): ``kind="dense"`` flattens its first
    argument's leading dimensions into rows; ``"experts"`` tiles every tensor argument that has as many rows as the
    first along its first dimension, each tile called through ``module``'s forward hooks when given (they see the
    tile's routing, in forward and in its recompute). Inputs of one tile or fewer run ``forward`` as it is."""
    tile_forward = _through_hooks(module, forward) if module is not None and kind == "experts" else forward

    @functools.wraps(forward)
    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]) if kind == "dense" else x
        n = rows.shape[0]
        if n <= tile_tokens:
            return forward(x, *args, **kwargs)
        out: torch.Tensor | None = None
        for start in range(0, n, tile_tokens):
            part = slice(start, min(start + tile_tokens, n))
            tile_args = [_rows(a, n, part) for a in args]
            tile_kwargs = {k: _rows(v, n, part) for k, v in kwargs.items()}
            if torch.is_grad_enabled():
                y = torch.utils.checkpoint.checkpoint(tile_forward, rows[part], *tile_args, use_reentrant=False,
                                                      **tile_kwargs)
            else:
                y = tile_forward(rows[part], *tile_args, **tile_kwargs)
            if out is None:
                out = y.new_empty((n, *y.shape[1:]))
            out[part] = y
            del y
        assert out is not None
        return out.view(*x.shape[:-1], out.shape[-1]) if kind == "dense" else out

    return run


def _through_hooks(module: nn.Module, forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``forward`` called as ``module(...)``: its forward hooks run for each tile (the tiling wrapper set aside)."""

    def call(*args: Any, **kwargs: Any) -> torch.Tensor:
        wrapper = module.__dict__.get("forward")
        module.forward = forward
        try:
            return module(*args, **kwargs)
        finally:
            if wrapper is None:
                del module.forward
            else:
                module.forward = wrapper

    return call


def _rows(value: Any, n: int, part: slice) -> Any:
    """``value[part]`` for a tensor of ``n`` rows (a per-token argument), else ``value``."""
    return value[part] if torch.is_tensor(value) and value.dim() and value.shape[0] == n else value


@contextlib.contextmanager
def tiled_mlps(model: nn.Module, tile_tokens: int) -> Iterator[list[str]]:
    """Inside the block, ``model``'s MLPs (:func:`mlp_targets`) compute in tiles of ``tile_tokens`` tokens; yields
    the names of the modules tiled. Restored on exit.

    Raises:
        ValueError: ``tile_tokens`` is not a positive int, or ``model`` has no MLP to tile.
    """
    check_int(tile_tokens, "tile_tokens", minimum=1, owner=_OWNER)
    targets = mlp_targets(model)
    if not targets:
        raise ValueError(f"{_OWNER}: {type(model).__name__} has no decoder layer or repeated block with an `mlp` to "
                         "tile")
    before = [(module, module.__dict__.get("forward")) for _, module, _ in targets]
    for _, module, kind in targets:
        module.forward = tiled_forward(module.forward, tile_tokens, kind, module)
    try:
        yield [name for name, _, _ in targets]
    finally:
        for module, forward in before:
            if forward is None:
                del module.forward  # the class's forward again
            else:
                module.forward = forward
