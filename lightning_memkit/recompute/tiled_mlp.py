"""Tiled MLP: each decoder layer's MLP computed over a few tokens at a time, so that its intermediate activations
(``tokens x intermediate``: the gate and up projections, their product) never exist for the whole sequence, in
forward or in backward (as Arctic Long Sequence Training's and Liger-Kernel's ``TiledMLP`` do).

An MLP is row-wise: each token's output depends on that token's input only. :func:`tiled_mlps` makes each target
split its input rows into tiles of ``tile_tokens`` and run them in one autograd function: forward computes the tiles
without autograd into one output tensor and keeps only the input (a view, saved as autograd saves tensors, so a
recomputed layer drops it and activation offload moves it); backward computes one tile at a time again, writes its
input's gradient into its rows and sums the parameters' gradients over the tiles, which autograd receives once (so
DDP's and FSDP2's hooks fire once). On an estimate's fake tensors one tile stands for the alike ones.

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
from lightning_memkit.measure.fake_repeat import alike_runs, estimating, stands_for

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
                  module: nn.Module) -> Callable[..., torch.Tensor]:
    """``forward`` (``module``'s) computed in tiles of ``tile_tokens`` rows (see the module): ``kind="dense"``
    flattens its first argument's leading dimensions into rows; ``"experts"`` tiles every tensor argument that has as
    many rows as the first along its first dimension, each tile called through ``module``'s forward hooks (they see
    the tile's routing, in forward and in its recompute). Inputs of one tile or fewer run ``forward`` as it is. The
    gradients of ``module``'s trainable parameters are summed over the tiles and given to autograd once."""
    tile_forward = _through_hooks(module, forward) if kind == "experts" else forward

    @functools.wraps(forward)
    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]) if kind == "dense" else x
        if rows.shape[0] <= tile_tokens:
            return forward(x, *args, **kwargs)
        tiles = _Tiles(tile_forward, tile_tokens, [rows, *args], kwargs, module)
        tensors = [v for v in (rows, *args, *kwargs.values()) if torch.is_tensor(v)]
        out = _TiledFunction.apply(tiles, *tensors, *(tiles.params() if torch.is_grad_enabled() else ()))
        return out.view(*x.shape[:-1], out.shape[-1]) if kind == "dense" else out

    return run


class _Tiles:
    """One tiled call of ``module``'s: the call, its arguments with their tensors taken out (none is kept here:
    autograd's saved tensors hold them, where recomputation and offload see them; :meth:`call` puts them back, a
    tile of its rows where they have one per row), the rows and the tile."""

    def __init__(self, call: Callable[..., torch.Tensor], tile: int, args: list[Any], kwargs: dict[str, Any],
                 module: nn.Module) -> None:
        self.fn, self.tile, self.module, self.names = call, tile, module, list(kwargs)
        values = [*args, *kwargs.values()]
        self.nargs, self.rows = len(args), args[0].shape[0]
        self.slots = [i for i, v in enumerate(values) if torch.is_tensor(v)]
        self.values = [None if torch.is_tensor(v) else v for v in values]

    def params(self) -> list[torch.Tensor]:
        """The module's trainable parameters (those its gradients are summed for)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def per_row(self, t: torch.Tensor) -> bool:
        """Whether ``t`` has one row per token (it is tiled)."""
        return t.dim() > 0 and t.shape[0] == self.rows

    def part(self, start: int) -> slice:
        return slice(start, min(start + self.tile, self.rows))

    def call(self, tensors: list[torch.Tensor], part: slice | None = None) -> torch.Tensor:
        """The call on ``tensors`` (the call's tensors, in order), each cut to ``part`` where it has one row per token
        (``None``: as they are)."""
        values = list(self.values)
        for i, t in zip(self.slots, tensors, strict=True):
            values[i] = t[part] if part is not None and self.per_row(t) else t
        return self.fn(*values[:self.nargs], **dict(zip(self.names, values[self.nargs:], strict=True)))


class _TiledFunction(torch.autograd.Function):
    """The tiles' outputs in one tensor. Forward keeps the tiled call's inputs (the rows: a view), nothing of a
    tile; backward computes each tile again and its gradients (the tile's inputs' into their rows, the trainable
    parameters' summed over the tiles), with the random and autocast state forward had. On fake tensors (an
    estimate) one tile stands for the alike ones (:mod:`~lightning_memkit.measure.fake_repeat`): in backward the
    last full tile runs apart, so a sum that is added to (not made) stands in the trace as in the run."""

    @staticmethod
    def forward(ctx, tiles: _Tiles, *tensors: torch.Tensor) -> torch.Tensor:  # noqa: D102
        inputs = tensors[:len(tiles.slots)]
        ctx.tiles, ctx.state, ctx.params = tiles, _State(inputs[0]), len(tensors) - len(inputs)
        ctx.save_for_backward(*inputs)
        out: torch.Tensor | None = None
        for start, count in alike_runs(tiles.rows, tiles.tile, estimating(inputs[0])):
            part = tiles.part(start)
            with stands_for(count):
                y = tiles.call(list(inputs), part)
                if out is None:
                    out = y.new_empty((tiles.rows, *y.shape[1:]))
                out[part] = y
            del y
        assert out is not None
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[Any, ...]:  # noqa: D102
        tiles, inputs = ctx.tiles, ctx.saved_tensors
        need = ctx.needs_input_grad[1:1 + len(inputs)]
        params = tiles.params() if ctx.params else []
        if len(params) != ctx.params:  # their gradients are given back in forward's order
            raise RuntimeError(f"{_OWNER}: {type(tiles.module).__name__}'s trainable parameters changed between "
                               "its forward and its backward")
        grads = [(torch.zeros_like(t) if n else None) for t, n in zip(inputs, need, strict=True)]
        summed: list[torch.Tensor | None] = [None] * len(params)
        with ctx.state.replayed():
            for start, count in _summing_runs(tiles.rows, tiles.tile, estimating(grad)):
                part = tiles.part(start)
                with stands_for(count):
                    _tile_backward(tiles, inputs, need, params, grad[part], part, grads, summed)
        return (None, *grads, *summed)


def _tile_backward(tiles: _Tiles, inputs: tuple[torch.Tensor, ...], need: tuple[bool, ...], params: list[Any],
                   grad: torch.Tensor, part: slice, grads: list[Any], summed: list[Any]) -> None:
    """One tile computed again and its gradients: its inputs' written into ``grads`` (their rows of it, or added
    where an input is not per row), the parameters' added to ``summed`` (the first tile's taken as they are)."""
    tile_in = [(t[part] if tiles.per_row(t) else t).detach().requires_grad_(n) for t, n in zip(inputs, need,
                                                                                             strict=True)]
    with torch.enable_grad():
        y = tiles.call(tile_in)
    wanted = [t for t, n in zip(tile_in, need, strict=True) if n] + params
    got = iter(torch.autograd.grad(y, wanted, grad, allow_unused=True))
    del y
    for i, t in enumerate(inputs):
        g = next(got) if need[i] else None
        if g is not None:
            if tiles.per_row(t):
                grads[i][part] = g
            else:
                grads[i] += g
    for j, g in enumerate(got):
        if g is not None:
            summed[j] = g if summed[j] is None else summed[j].add_(g)


def _summing_runs(stop: int, step: int, fake: bool) -> list[tuple[int, int]]:
    """:func:`~lightning_memkit.measure.fake_repeat.alike_runs`, with the last full step of a standing run apart
    (the first tile makes the parameters' sums, every later one adds to them: the trace needs one of each)."""
    runs = alike_runs(stop, step, fake)
    if runs and runs[0][1] > 1:
        count = runs[0][1]
        runs[:1] = [(0, count - 1), ((count - 1) * step, 1)]
    return runs


class _State:
    """The random generators' and autocast's state when a tiled forward began, put back for its backward (an MLP
    with dropout draws the same masks again); nothing of the generators on fake tensors (an estimate)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in sorted({x.device.type, "cpu"})]
        self.device = x.device if x.device.type == "cuda" else None
        self.rng = None if estimating(x) else (torch.get_rng_state(),
                                                torch.cuda.get_rng_state(x.device) if self.device else None)

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.rng is not None:
                stack.enter_context(torch.random.fork_rng(devices=[self.device] if self.device else []))
                torch.set_rng_state(self.rng[0])
                if self.device is not None:
                    torch.cuda.set_rng_state(self.rng[1], self.device)
            for device, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            yield


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
