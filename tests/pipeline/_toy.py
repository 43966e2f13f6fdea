"""A small language model split into pipeline layers: a wide embedding and head around narrow blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.emb(tokens)


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def toy_layers(
    vocab: int = 96, dim: int = 16, blocks: int = 6, seed: int = 0, plain_head: bool = False
) -> nn.ModuleList:
    """``[embedding, blocks..., head]``; ``plain_head`` ends with ``LayerNorm`` and a bare ``nn.Linear`` instead."""
    torch.manual_seed(seed)
    head = [nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)] if plain_head else [Head(dim, vocab)]
    return nn.ModuleList([Embed(vocab, dim), *(Block(dim) for _ in range(blocks)), *head])


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def toy_batch(batch: int, seq: int, vocab: int = 96, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def reference(layers: nn.ModuleList, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = x
    for layer in layers:
        out = layer(out)
    return lm_loss(out, y)


# -- layers that pass tuples: hidden states with an int padding mask and shared positions -----------------
class PairEmbed(nn.Module):
    """``(tokens, mask) -> (hidden, mask, positions)``: positions ``(1, T)`` are shared by the rows."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor):
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        return self.emb(tokens), mask, positions


class PairBlock(Block):
    """A block that only updates kept positions (``mask == 1``) and adds a sinusoid of the positions.

    torch's shape inference runs a non-first stage once on uninitialized tensors: received ints must not index.
    """

    def __init__(self, dim: int):
        super().__init__(dim)
        self.freq = nn.Parameter(torch.linspace(0.1, 1.0, dim))

    def forward(self, x, mask, positions):
        update = self.down(F.gelu(self.up(self.norm(x + torch.sin(positions.unsqueeze(-1) * self.freq)))))
        return x + update * mask.unsqueeze(-1).to(x.dtype), mask, positions


class PairHead(Head):
    def forward(self, x, mask, positions):
        return super().forward(x)


def pair_layers(vocab: int = 96, dim: int = 16, blocks: int = 4, seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList([PairEmbed(vocab, dim), *(PairBlock(dim) for _ in range(blocks)), PairHead(dim, vocab)])


def pair_batch(batch: int, seq: int, vocab: int = 96, seed: int = 2):
    """``((tokens, mask), target)``: padded tails (mask 0) whose targets are -100."""
    x, y = toy_batch(batch, seq, vocab, seed)
    g = torch.Generator().manual_seed(seed)
    keep = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    mask = (torch.arange(seq).unsqueeze(0) < keep.unsqueeze(1)).long()
    return (x, mask), y.masked_fill(mask == 0, -100)


def pair_reference(layers: nn.ModuleList, inputs, y: torch.Tensor) -> torch.Tensor:
    out = inputs
    for layer in layers:
        out = layer(*out) if isinstance(out, tuple) else layer(out)
    return lm_loss(out, y)  # mean over the targets that are not -100
