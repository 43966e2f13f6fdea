"""The model of ``bench_pipeline_partition`` and one rank of its measured 4-process run (pure torch, gloo).

    RANK=0 WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python -m benchmarks._pipeline_partition_worker OUT.json '{"vocab": 4096, ...}' '[[7, 9, 12, 4], ...]'
"""

from __future__ import annotations

import json
import sys

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


def layers(vocab: int, dim: int, blocks: int, **_) -> nn.ModuleList:
    """A large embedding and head (``vocab x dim`` each) around ``blocks`` narrow MLP blocks."""
    torch.manual_seed(0)
    return nn.ModuleList([Embed(vocab, dim), *(Block(dim) for _ in range(blocks)), Head(dim, vocab)])


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def batch(vocab: int, batch: int, seq: int, **_) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def measure(config: dict, sizes: list[int]) -> int:
    """This rank's LivePeak over steady-state 1F1B steps (AdamW) with the given split."""
    import torch.distributed as dist

    from lightning_memkit.memory import LivePeak
    from lightning_memkit.pipeline import evaluate_partition
    from lightning_memkit.pipeline.runtime import PipelineRuntime

    x, y = batch(**config)
    part = evaluate_partition([1] * (config["blocks"] + 2), sizes, schedule="1f1b", microbatches=config["microbatches"])
    with LivePeak() as lp:
        runtime = PipelineRuntime(layers(**config), part, loss_fn=lm_loss)
        opt = torch.optim.AdamW(runtime.parameters(), lr=1e-3, foreach=False)
        lp.reset_peak()  # drop the moment this rank still held the whole model
        for step in range(2):
            runtime.train_step(x, y)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == 0:
                lp.reset_peak()  # the first step also infers shapes: measure the steady state
    dist.barrier()
    return lp.peak_bytes


def main(out: str, config: str, splits: str) -> None:
    import datetime as dt

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=120))
    cfg = json.loads(config)
    peaks = [measure(cfg, sizes) for sizes in json.loads(splits)]
    with open(out.replace("RANK", str(dist.get_rank())), "w") as f:
        json.dump(peaks, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.modules["lightning"] = None  # type: ignore[assignment]  # the pure-torch core needs no Lightning
    main(*sys.argv[1:4])
