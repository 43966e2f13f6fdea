"""TinyLM as an ordered list of pipeline layers: embeddings, transformer blocks, final norm, LM head.

The layers share TinyLM's own submodules (no copy): ``TokenPositionEmbedding`` wraps ``tok_emb`` and
``pos_emb``; the blocks, ``norm`` and ``head`` are used as they are, so the head is a plain ``nn.Linear``
(which ``MemkitPipelineStrategy(fused_loss=True)`` needs).

Example::

    >>> import torch
    >>> from lightning_memkit.demo import TinyLM
    >>> from lightning_memkit.demo.pipeline_layers import tiny_lm_layers
    >>> model = TinyLM(d_model=16, n_layers=2, n_heads=2, seq_len=8)
    >>> x = torch.randint(0, 256, (2, 8))
    >>> out = x
    >>> for layer in tiny_lm_layers(model):
    ...     out = layer(out)
    >>> torch.equal(out, model(x)), len(tiny_lm_layers(model))
    (True, 5)
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TokenPositionEmbedding", "tiny_lm_layers"]


class TokenPositionEmbedding(nn.Module):
    """``tok_emb(tokens) + pos_emb(positions)`` for int tokens ``(batch, time)``."""

    def __init__(self, tok_emb: nn.Embedding, pos_emb: nn.Embedding):
        super().__init__()
        self.tok_emb, self.pos_emb = tok_emb, pos_emb

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.pos_emb.num_embeddings:
            raise ValueError(f"sequence length {t} exceeds the {self.pos_emb.num_embeddings} learned positions")
        return self.tok_emb(tokens) + self.pos_emb(torch.arange(t, device=tokens.device))


def tiny_lm_layers(model: nn.Module) -> nn.ModuleList:
    """The pipeline layers of a TinyLM (``model.tok_emb``, ``pos_emb``, ``blocks``, ``norm``, ``head``)."""
    return nn.ModuleList([TokenPositionEmbedding(model.tok_emb, model.pos_emb), *model.blocks, model.norm, model.head])
