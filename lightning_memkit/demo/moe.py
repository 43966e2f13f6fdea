"""TinyMoE: a small byte-level transformer whose feed-forward layers are top-k mixtures of experts.

Each :class:`MoEFeedForward` runs the stages of an expert-parallel layer in one process: route (top-k
softmax), permute the tokens by expert (:func:`~lightning_memkit.ops.padded_index_gather`), exchange
them (the dispatch all-to-all), run the experts, exchange back and combine (weighted ``index_add``).
The tensors handed between stages are marked with :func:`~lightning_memkit.release.stage_boundary`:

* the dispatch input (the permuted tokens), read only by the dispatch exchange;
* the expert outputs, read only by the combine exchange.

With ``exchange="identity"`` (expert parallelism off, as on a single rank) the exchanges return their
input, so both are still read by the experts and the combine: the safety check refuses their release
and the layer keeps them (``on_refuse="keep"``, recorded in the block's ``BoundaryStats``).
``exchange="copy"`` models the all-to-all, which writes into a new buffer. Marks act only inside a
``release_stage_boundaries`` block (the ``StageBoundaryRelease`` callback); elsewhere they are no-ops.

Example::

    >>> import torch
    >>> from lightning_memkit.demo import TinyMoE
    >>> model = TinyMoE(d_model=32, n_layers=1, n_heads=2, seq_len=16, n_experts=4, top_k=2, d_expert=32)
    >>> model(torch.randint(0, 256, (3, 16))).shape
    torch.Size([3, 16, 256])
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memkit.common.validation import check_int, check_number
from lightning_memkit.demo.tiny_lm import CausalSelfAttention
from lightning_memkit.ops import padded_index_gather
from lightning_memkit.release.stage_boundary import stage_boundary

__all__ = ["TinyMoE", "MoEFeedForward", "MoEBlock", "Experts", "TokenExchange", "Combine", "EXCHANGES"]

VOCAB = 256
EXCHANGES = ("identity", "copy")




class TokenExchange(nn.Module):
    """The all-to-all of an expert-parallel layer, in one process: ``"copy"`` writes a new buffer (as the
    collective does), ``"identity"`` returns its input (expert parallelism off)."""

    def __init__(self, mode: str = "identity"):
        super().__init__()
        if mode not in EXCHANGES:
            raise ValueError(f"TokenExchange(mode={mode!r}) is not allowed; allowed: {EXCHANGES}")
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone() if self.mode == "copy" else x


class Experts(nn.Module):
    """``n_experts`` GELU MLPs ``d_model -> d_expert -> d_model`` over contiguous groups of rows."""

    def __init__(self, n_experts: int, d_model: int, d_expert: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, d_model, d_expert) * 0.02)
        self.w2 = nn.Parameter(torch.randn(n_experts, d_expert, d_model) * 0.02)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # split/unbind (not x[a:b], w1[e]): their backward writes every piece's gradient into one buffer,
        # where slicing would allocate a full-size zero gradient per piece and sum them
        groups = zip(x.split(counts), self.w1.unbind(0), self.w2.unbind(0))
        return torch.cat([F.gelu(xe @ w1) @ w2 for xe, w1, w2 in groups])


class _WeightedIndexAdd(torch.autograd.Function):
    """``out[idx[i]] += w[i] * x[i]``; saves ``x``, ``w`` and ``idx``; backward allocates one ``x``-sized
    buffer (``grad[idx]``, scaled in place), where ``index_add(x * w)`` would keep ``x * w`` for its shape
    and its backward would allocate three."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, num_rows: int) -> torch.Tensor:
        ctx.save_for_backward(x, w, idx)
        return x.new_zeros(num_rows, x.shape[-1]).index_add_(0, idx, x * w[:, None])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, idx = ctx.saved_tensors
        rows = grad.index_select(0, idx)
        grad_w = torch.bmm(rows.unsqueeze(1), x.unsqueeze(2)).view(-1) if ctx.needs_input_grad[1] else None
        return rows.mul_(w[:, None]), grad_w, None, None


class Combine(nn.Module):
    """Exchange the expert outputs back and sum them per token, weighted by the router."""

    def __init__(self, exchange: str = "identity"):
        super().__init__()
        self.exchange = TokenExchange(exchange)

    def forward(self, expert_out: torch.Tensor, weights: torch.Tensor, token_idx: torch.Tensor,
                num_tokens: int) -> torch.Tensor:
        return _WeightedIndexAdd.apply(self.exchange(expert_out), weights, token_idx, num_tokens)


class MoEFeedForward(nn.Module):
    """Top-k mixture-of-experts feed-forward layer (see the module docstring for its stages).

    Args:
        d_model: token width.
        n_experts: number of experts.
        top_k: experts per token.
        d_expert: hidden width of each expert.
        exchange: ``"identity"`` (expert parallelism off) or ``"copy"`` (models the all-to-all).
        pad_to_multiple: row multiple of the permuted-token allocation (see ``padded_index_gather``).

    ``forward(x, keep=None)``: pass a list as ``keep`` to receive the stage tensors (dispatch input,
    expert input, expert output), as a schedule that runs each stage's backward separately keeps them.
    ``aux_loss`` holds the load-balancing loss of the last forward.
    """

    def __init__(self, d_model: int, n_experts: int = 8, top_k: int = 2, d_expert: int | None = None,
                 exchange: str = "identity", pad_to_multiple: int = 256):
        super().__init__()
        for name, value in (("d_model", d_model), ("n_experts", n_experts), ("top_k", top_k),
                            ("pad_to_multiple", pad_to_multiple)):
            check_int(value, name, minimum=1, owner="MoEFeedForward")
        check_int(d_expert, "d_expert", minimum=1, allow_none=True, owner="MoEFeedForward")  # None: d_model
        d_expert = d_model if d_expert is None else d_expert
        if top_k > n_experts:
            raise ValueError(f"MoEFeedForward(top_k={top_k}) must be <= n_experts={n_experts}")
        if exchange not in EXCHANGES:
            raise ValueError(f"MoEFeedForward(exchange={exchange!r}) is not allowed; allowed: {EXCHANGES}")
        self.n_experts, self.top_k, self.pad_to_multiple = n_experts, top_k, pad_to_multiple
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.dispatch = TokenExchange(exchange)
        self.experts = Experts(n_experts, d_model, d_expert)
        self.combine = Combine(exchange)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, keep: list | None = None) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = self.router(tokens).softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        token_idx = order // self.top_k
        counts_t = torch.bincount(flat, minlength=self.n_experts)
        # Switch-style balance loss: n_experts * sum(fraction routed to e * mean router probability of e)
        self.aux_loss = self.n_experts * (counts_t.to(probs.dtype) / flat.numel() * probs.mean(dim=0)).sum()

        permuted = padded_index_gather(tokens, token_idx, self.pad_to_multiple)  # dispatch input
        held = () if keep is None else keep  # a schedule's list of stage outputs reads only their metadata
        stage_boundary(permuted, consumers=self.dispatch, on_refuse="keep", held_by=held)
        expert_in = self.dispatch(permuted)
        expert_out = self.experts(expert_in, counts_t.tolist())
        stage_boundary(expert_out, consumers=self.combine.exchange, on_refuse="keep", held_by=held)
        if keep is not None:
            keep.extend((permuted, expert_in, expert_out))
        out = self.combine(expert_out, weights.reshape(-1)[order], token_idx, tokens.shape[0])
        return out.view(shape)


class MoEBlock(nn.Module):
    """Pre-norm transformer block with a mixture-of-experts feed-forward."""

    def __init__(self, d_model: int, n_heads: int, **moe):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.moe = MoEFeedForward(d_model, **moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class TinyMoE(pl.LightningModule):
    """Decoder-only mixture-of-experts transformer over bytes, trained with next-token cross-entropy.

    Args:
        d_model: width of the residual stream.
        n_layers: number of blocks (``self.blocks``).
        n_heads: attention heads; must divide ``d_model``.
        seq_len: longest sequence.
        n_experts: experts per layer.
        top_k: experts per token.
        d_expert: hidden width of each expert (``None``: ``d_model``); the default, half of ``d_model``, gives
            fine-grained experts as in recent MoE models.
        exchange: ``"identity"`` or ``"copy"`` (see :class:`MoEFeedForward`).
        pad_to_multiple: row multiple of the permuted-token allocation.
        aux_loss_coef: weight of the load-balancing loss.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.

    Example::

        from lightning.pytorch import Trainer
        from lightning_memkit.callbacks import StageBoundaryRelease
        from lightning_memkit.demo import ByteTextDataModule, TinyMoE

        Trainer(max_steps=50, callbacks=[StageBoundaryRelease()]).fit(TinyMoE(), ByteTextDataModule())
    """

    def __init__(self, d_model: int = 64, n_layers: int = 2, n_heads: int = 4, seq_len: int = 128,
                 n_experts: int = 16, top_k: int = 4, d_expert: int | None = 32, exchange: str = "identity",
                 pad_to_multiple: int = 256, aux_loss_coef: float = 0.01, lr: float = 3e-3,
                 weight_decay: float = 0.01):
        super().__init__()
        for name, value in (("d_model", d_model), ("n_layers", n_layers), ("n_heads", n_heads),
                            ("seq_len", seq_len)):
            check_int(value, name, minimum=1, owner="TinyMoE")
        if d_model % n_heads:
            raise ValueError(f"TinyMoE(n_heads={n_heads}) must divide d_model={d_model}")
        for name, value, positive in (("lr", lr, True), ("weight_decay", weight_decay, False),
                                      ("aux_loss_coef", aux_loss_coef, False)):
            check_number(value, name, minimum=0, min_inclusive=not positive, owner="TinyMoE")
        self.save_hyperparameters()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(VOCAB, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        moe = dict(n_experts=n_experts, top_k=top_k, d_expert=d_expert, exchange=exchange,
                   pad_to_multiple=pad_to_multiple)
        self.blocks = nn.ModuleList(MoEBlock(d_model, n_heads, **moe) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, time, 256)`` for int tokens ``(batch, time)``."""
        t = tokens.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds TinyMoE(seq_len={self.seq_len})")
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def aux_loss(self) -> torch.Tensor:
        """Sum of the blocks' load-balancing losses from the last forward."""
        return sum(b.moe.aux_loss for b in self.blocks)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        ce = F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))
        return ce, ce + self.hparams.aux_loss_coef * self.aux_loss()

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        ce, loss = self._loss(batch)
        self.log("train_loss", ce, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> torch.Tensor:
        ce, _ = self._loss(batch)
        self.log("val_loss", ce, prog_bar=True)
        return ce

    def test_step(self, batch, batch_idx: int) -> torch.Tensor:
        """The validation loss (cross-entropy, no auxiliary term) on the test batches, logged as ``test_loss``."""
        ce, _ = self._loss(batch)
        self.log("test_loss", ce)
        return ce

    def predict_step(self, batch, batch_idx: int) -> torch.Tensor:
        """Greedy next-byte predictions: the argmax byte after each position, int64 ``(batch, time)``.

        ``batch`` is ``(x, y)`` as in training (``y`` is ignored) or the tokens ``x`` alone.
        """
        tokens = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(tokens).argmax(dim=-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.hparams.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95))
