"""TinyLM: a small decoder-only byte-level transformer, sized to train on a laptop CPU in minutes.

Example::

    >>> import torch
    >>> from lightning_memkit.demo import TinyLM
    >>> model = TinyLM(d_model=32, n_layers=2, n_heads=2, seq_len=16)
    >>> model(torch.randint(0, 256, (3, 16))).shape
    torch.Size([3, 16, 256])
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memkit.common.validation import check_bool, check_int, check_number
from lightning_memkit.ops import lm_head_loss

__all__ = ["TinyLM", "Block", "LOSSES"]

LOSSES = ("standard", "fused")
VOCAB = 256  # bytes


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, c // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(), nn.Linear(mlp_ratio * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(pl.LightningModule):
    """Decoder-only transformer over bytes (vocabulary 256), trained with next-token cross-entropy.

    Layout: token embedding + learned positions, ``n_layers`` pre-norm blocks in ``self.blocks`` (an
    ``nn.ModuleList``, so per-layer reports read ``blocks.0``, ``blocks.1``, ...), a final LayerNorm and
    an LM head. Optimiser: AdamW.

    Args:
        d_model: width of the residual stream.
        n_layers: number of transformer blocks.
        n_heads: attention heads; must divide ``d_model``.
        seq_len: longest sequence (size of the position table).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        loss: ``"standard"`` (logits, then ``F.cross_entropy``) or ``"fused"`` (head and loss in one
            chunked op, :func:`lightning_memkit.ops.lm_head_loss`: full-vocabulary logits never exist).
        tie_embeddings: the LM head uses the token embedding's weight (one tensor, as HF's
            ``tie_word_embeddings=True``).

    Example::

        from lightning.pytorch import Trainer
        from lightning_memkit.demo import ByteTextDataModule, TinyLM

        Trainer(max_steps=100).fit(TinyLM(), ByteTextDataModule())
    """

    def __init__(
        self,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        seq_len: int = 128,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        loss: str = "standard",
        tie_embeddings: bool = False,
    ):
        super().__init__()
        for name, value in (("d_model", d_model), ("n_layers", n_layers), ("n_heads", n_heads), ("seq_len", seq_len)):
            check_int(value, name, minimum=1, owner="TinyLM")
        if d_model % n_heads:
            raise ValueError(f"TinyLM(n_heads={n_heads}) must divide d_model={d_model}")
        check_number(lr, "lr", minimum=0, min_inclusive=False, owner="TinyLM")
        check_number(weight_decay, "weight_decay", minimum=0, owner="TinyLM")
        if loss not in LOSSES:
            raise ValueError(f"TinyLM(loss={loss!r}) is not supported; allowed: {', '.join(map(repr, LOSSES))}")
        check_bool(tie_embeddings, "tie_embeddings", owner="TinyLM")
        self.save_hyperparameters()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(VOCAB, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        self.apply(self._init_weights)
        if tie_embeddings:
            self.head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor, hidden: bool = False) -> torch.Tensor:
        """Logits ``(batch, time, 256)`` for int tokens ``(batch, time)``; ``hidden=True`` stops before the head."""
        t = tokens.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds TinyLM(seq_len={self.seq_len})")
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        h = self.norm(x)
        return h if hidden else self.head(h)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if self.hparams.loss == "fused":
            return lm_head_loss(self(x, hidden=True), self.head, y)
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch, batch_idx: int) -> torch.Tensor:
        """The validation loss on the test batches, logged as ``test_loss``."""
        loss = self._loss(batch)
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch, batch_idx: int) -> torch.Tensor:
        """Greedy next-byte predictions: the argmax byte after each position, int64 ``(batch, time)``.

        ``batch`` is ``(x, y)`` as in training (``y`` is ignored) or the tokens ``x`` alone.
        """
        tokens = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(tokens).argmax(dim=-1)

    def pipeline_layers(self) -> nn.ModuleList:
        """Layers in order for ``strategy="memkit_pipeline"``: embeddings, blocks, final norm, head."""
        from lightning_memkit.demo.pipeline_layers import tiny_lm_layers

        return tiny_lm_layers(self)

    def pipeline_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of one microbatch (the pipeline's last stage calls it)."""
        return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95))
