"""One rank of the 2-D mesh tests (pipeline x data parallel). Run by tests/strategies/test_pipeline_mesh.py.

    LOCAL_RANK=r NODE_RANK=0 WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python _pipeline_mesh_worker.py OUT PHASE

PHASE ``mesh``: 4 ranks, ``pipeline_parallel_size=2`` (2 replicas): a fit with global-norm clipping, the same
fit resumed from its step-2 checkpoint, and (rank 0) the single-process reference over the same global batches.
PHASE ``fsdp``: 4 ranks, the stages sharded over the 2 replicas (FSDP2), with a tied head.
PHASE ``kill``: 4 ranks, rank 3 exits at step 1; the others must fail, not hang.
PHASE ``one_replica``: 2 ranks (1 replica) validate the step-2 checkpoint of the 2-replica run.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit.demo import TinyLM
from lightning_memkit.strategies import MemkitPipelineStrategy, load_pipeline_state_dict

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
SEQ, N, BATCH, REPLICAS, EPOCHS = 8, 16, 4, 2, 2  # 2 steps an epoch
CLIP, VALUE = 0.5, 0.002  # small enough that both clippings change the run (the test checks it)


class SGDLM(TinyLM):
    """TinyLM with SGD and momentum: AdamW would turn the rounding noise of gradients that are zero in exact
    arithmetic (the attention key bias) into updates of size lr, so two exact orders of summation could differ
    by 1e-5 there; SGD keeps the comparison well conditioned."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def model(tied: bool = False) -> TinyLM:
    torch.manual_seed(0)
    return SGDLM(d_model=16, n_layers=2, n_heads=2, seq_len=SEQ, tie_embeddings=tied)


def dataset() -> TensorDataset:
    tokens = torch.randint(0, 256, (N, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class Record(Callback):
    def __init__(self):
        self.train = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append(float(outputs["loss"]))


def trainer(out: Path, devices: int, callbacks, data_parallel: str = "ddp", **kw) -> pl.Trainer:
    kw.setdefault("gradient_clip_val", CLIP)
    return pl.Trainer(
        accelerator="cpu", devices=devices, max_epochs=EPOCHS, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=out,
        limit_val_batches=1,
        strategy=MemkitPipelineStrategy(microbatches=2, timeout=60, pipeline_parallel_size=2,
                                        data_parallel=data_parallel), **kw,
    )


def batches() -> list[list[int]]:
    """The global batch of each step: both replicas' batches (Lightning's DistributedSampler, shuffled, seed 0)."""
    out = []
    for epoch in range(EPOCHS):
        order = torch.randperm(N, generator=torch.Generator().manual_seed(epoch)).tolist()  # seed 0 + epoch
        shards = [order[r::REPLICAS] for r in range(REPLICAS)]
        out += [[i for shard in shards for i in shard[s * BATCH:(s + 1) * BATCH]]
                for s in range(N // (BATCH * REPLICAS))]
    return out


def reference(clip=lambda params: torch.nn.utils.clip_grad_norm_(params, CLIP), tied: bool = False) -> dict:
    """One process over the same global batches, clipped by the norm of all gradients (or by ``clip``)."""
    lm = model(tied)
    opt = lm.configure_optimizers()
    data = dataset()
    losses = []
    for idx in batches():
        x, y = data[idx]
        loss = lm.pipeline_loss(lm(x), y)
        loss.backward()
        clip(list(lm.parameters()))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"train": losses, "state": {k: v.tolist() for k, v in lm.state_dict().items()}}


def mesh(out: Path, rank: int) -> dict:
    record = Record()
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", save_top_k=-1, every_n_epochs=1)
    first = trainer(out, 4, [record, ckpt])
    first.fit(model(), DataLoader(dataset(), batch_size=BATCH))
    result = {"train": record.train, "sampler": type(first.train_dataloader.sampler).__name__,
              "sampler_rank": first.train_dataloader.sampler.rank, "mesh": list(first.strategy.mesh_shape)}
    step2 = str(out / "ckpt" / "epoch=0-step=2.ckpt")
    val = first.validate(model(), DataLoader(dataset(), batch_size=BATCH), ckpt_path=step2, verbose=False)
    result["val_step2"] = val[0]["val_loss"]
    resumed = Record()
    second = trainer(out, 4, [resumed, ModelCheckpoint(dirpath=out / "ckpt_resumed", save_top_k=-1,
                                                       every_n_epochs=1)])
    second.fit(model(), DataLoader(dataset(), batch_size=BATCH), ckpt_path=str(out / "ckpt" / "epoch=0-step=2.ckpt"))
    result["resumed"] = resumed.train
    by_value = Record()
    trainer(out / "value", 4, [by_value], gradient_clip_val=VALUE, gradient_clip_algorithm="value").fit(
        model(), DataLoader(dataset(), batch_size=BATCH))
    result["value"] = by_value.train
    tied = Record()
    trainer(out / "tied", 4, [tied, ModelCheckpoint(dirpath=out / "ckpt_tied", save_top_k=1)]).fit(
        model(tied=True), DataLoader(dataset(), batch_size=BATCH))
    result["tied"] = tied.train
    if rank == 0:
        ref = reference(tied=True)
        result["tied_reference"] = ref["train"]
        merged = load_pipeline_state_dict(out / "ckpt_tied" / "epoch=1-step=4.ckpt")
        result["tied_keys"] = sorted(k for k in merged if k in ("tok_emb.weight", "head.weight"))
        result["tied_equal"] = torch.equal(merged["tok_emb.weight"], merged["head.weight"])
        result["tied_error"] = max(float((merged[k] - torch.tensor(v)).abs().max()) for k, v in ref["state"].items()
                                   if k in merged)
        result["value_reference"] = reference(lambda ps: torch.nn.utils.clip_grad_value_(ps, VALUE))["train"]
        a = load_pipeline_state_dict(out / "ckpt" / "epoch=1-step=4.ckpt")
        b = load_pipeline_state_dict(out / "ckpt_resumed" / "epoch=1-step=4.ckpt")
        result["resumed_equal"] = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
        result["state"] = {k: v.tolist() for k, v in a.items()}
        result["reference"] = reference()
    return result


def fsdp(out: Path, rank: int) -> dict:
    result = {}
    for tied in (False, True):
        record = Record()
        ckpt = ModelCheckpoint(dirpath=out / f"fsdp_ckpt{tied}", save_top_k=-1, every_n_epochs=1)
        t = trainer(out / f"fsdp{tied}", 4, [record, ckpt], data_parallel="fsdp")
        t.fit(model(tied), DataLoader(dataset(), batch_size=BATCH))
        stage = t.strategy.runtime.modules[0]
        result[f"train_{tied}"] = record.train
        result["sharded"] = type(next(stage.parameters())).__name__
        if rank == 0:
            ref = reference(tied=tied)
            result[f"reference_{tied}"] = ref["train"]
            merged = load_pipeline_state_dict(out / f"fsdp_ckpt{tied}" / "epoch=1-step=4.ckpt")
            result[f"state_error_{tied}"] = max(float((merged[k] - torch.tensor(v)).abs().max())
                                                for k, v in ref["state"].items())
    resumed = Record()  # the sharded run resumed from its epoch-0 checkpoint (full tensors, cut again)
    trainer(out / "fsdp_resumed", 4, [resumed], data_parallel="fsdp", enable_checkpointing=False).fit(
        model(), DataLoader(dataset(), batch_size=BATCH), ckpt_path=str(out / "fsdp_ckptFalse" / "epoch=0-step=2.ckpt"))
    result["resumed"] = resumed.train
    replicated = Record()  # the same checkpoint resumed by replicated (DDP) stages
    trainer(out / "ddp_resumed", 4, [replicated], enable_checkpointing=False).fit(
        model(), DataLoader(dataset(), batch_size=BATCH), ckpt_path=str(out / "fsdp_ckptFalse" / "epoch=0-step=2.ckpt"))
    result["resumed_ddp"] = replicated.train
    by_value = Record()
    t = trainer(out / "fsdp_value", 4, [by_value], data_parallel="fsdp", enable_checkpointing=False,
                gradient_clip_val=VALUE, gradient_clip_algorithm="value")
    t.fit(model(), DataLoader(dataset(), batch_size=BATCH))
    result["value"] = by_value.train
    if rank == 0:
        result["value_reference"] = reference(lambda ps: torch.nn.utils.clip_grad_value_(ps, VALUE))["train"]
    return result


class DieAtStep(Callback):
    """Rank 3 (the last stage of replica 1) exits abruptly at the start of step 1."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 1 and trainer.global_rank == 3:
            os._exit(17)


def kill(out: Path, rank: int) -> dict:
    t = pl.Trainer(
        accelerator="cpu", devices=4, max_epochs=EPOCHS, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[DieAtStep()], enable_checkpointing=False,
        strategy=MemkitPipelineStrategy(microbatches=2, timeout=10, pipeline_parallel_size=2),
    )
    t.fit(model(), DataLoader(dataset(), batch_size=BATCH))
    return {"finished": True}  # not reached on any rank: the others fail once rank 3 is gone


def one_replica(out: Path, rank: int) -> dict:
    t = trainer(out / "one", 2, [])
    val = t.validate(model(), DataLoader(dataset(), batch_size=BATCH * REPLICAS),
                     ckpt_path=str(out / "ckpt" / "epoch=0-step=2.ckpt"), verbose=False)
    return {"val_step2": val[0]["val_loss"], "mesh": list(t.strategy.mesh_shape)}


def main() -> None:
    out, phase = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["LOCAL_RANK"])
    result = {"mesh": mesh, "fsdp": fsdp, "kill": kill, "one_replica": one_replica}[phase](out, rank)
    (out / f"{phase}_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
