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
