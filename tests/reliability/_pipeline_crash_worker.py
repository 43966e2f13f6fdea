"""One rank of the crash-injection test. Run by tests/reliability/test_pipeline_checkpoint.py.

    LOCAL_RANK=0 NODE_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python _pipeline_crash_worker.py OUT crash PHASE VICTIM   # save A (step 2), die during B (step 4)
    ... python _pipeline_crash_worker.py OUT resume                # resume from OUT/ckpt/last.ckpt and from a copy of A
    python _pipeline_crash_worker.py OUT single                     # one process, no rank variables

``crash``: TinyLM on 2 pipeline ranks; ``ModelCheckpoint`` overwrites ``OUT/ckpt/last.ckpt`` every epoch (2 steps).
Rank 0 copies checkpoint A to ``OUT/A`` once it is committed; rank ``VICTIM`` calls ``os._exit(CRASH)`` at
``PHASE`` of the save of B. ``resume``: a fresh run from ``last.ckpt`` and, as the reference, one from the copy
of A (each to step 6), then a resume from A with one byte of rank 1's shard flipped. Results go to
``OUT/<mode>_rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit.demo import TinyLM
from lightning_memkit.pipeline import checkpoint as ckpt_format
from lightning_memkit.strategies import MemkitPipelineStrategy, load_pipeline_state_dict

warnings.filterwarnings("ignore")
CRASH = 77
SEQ = 8
BATCHES, EPOCHS = 2, 3  # checkpoints at epoch ends: a plain DataLoader cannot resume mid-epoch exactly
STEP_A, STEP_B = BATCHES, 2 * BATCHES


def model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(d_model=16, n_layers=2, n_heads=2, seq_len=SEQ, lr=1e-2)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (4 * BATCHES, SEQ + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)


class Record(Callback):
    """Every training loss, appended to ``file`` as it comes (so that a crashed run leaves its losses)."""

    def __init__(self, file: Path | None = None):
        self.train, self.file = [], file

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append(float(outputs["loss"]))
        if self.file is not None:
            self.file.write_text(json.dumps(self.train))


class CopyCommitted(Callback):
    """Rank 0 copies the committed checkpoint A aside, before B is saved over it."""

    def __init__(self, src: Path, dst: Path, step: int = STEP_A):
        self.src, self.dst, self.step = src, dst, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and trainer.is_global_zero:
            shutil.copytree(self.src, self.dst)


def checkpointing(dirpath: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=dirpath, filename="last", every_n_epochs=1, save_on_train_epoch_end=True,
                           save_top_k=1, enable_version_counter=False)


def trainer(out: Path, callbacks: list, timeout: float = 60, devices: int = 2, epochs: int = EPOCHS) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=devices, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=callbacks, default_root_dir=out,
        strategy=MemkitPipelineStrategy(microbatches=2, partition="uniform", timeout=timeout),
    )


def inject(phase: str, victim: int, rank: int) -> None:
    """Make this rank die (``os._exit``) at ``phase`` of the save at step ``STEP_B``, if it is the victim.

    ``before_*``/``after_*`` die at that point; ``during_*`` arm at ``before_*`` and die halfway through a write.
    """
    if rank != victim:
        return
    write_shard, write_manifest = ckpt_format.write_shard, ckpt_format.write_manifest
    write = ckpt_format._HashingWriter.write
    armed = []

    def at(point: str, step: int) -> None:
        if step == STEP_B and point == phase:
            os._exit(CRASH)
        if step == STEP_B and phase == point.replace("before_", "during_"):
            armed.append(True)

    def shard(directory, state, *, global_step, **kwargs):
        at("before_shard", global_step)
        entry = write_shard(directory, state, global_step=global_step, **kwargs)
        at("after_shard", global_step)
        return entry

    def manifest(directory, content):
        at("before_manifest", content["global_step"])
        return write_manifest(directory, content)

    def partial_write(self, data):
        if armed and (len(data) >= 1024 or phase == "during_manifest"):
            write(self, bytes(data)[: len(data) // 2])  # part of the bytes reach the temporary file
            self.flush()
            os._exit(CRASH)
        return write(self, data)

    ckpt_format.write_shard, ckpt_format.write_manifest = shard, manifest
    ckpt_format._HashingWriter.write = partial_write


def crash_run(out: Path, rank: int, phase: str, victim: int) -> None:
    inject(phase, victim, rank)
    ckpt = out / "ckpt"
    record = Record(out / f"crash_losses_rank{rank}.json")
    trainer(out, [record, CopyCommitted(ckpt / "last.ckpt", out / "A"), checkpointing(ckpt)], timeout=20).fit(
        model(), loader()
    )


def fit_from(out: Path, ckpt_path: Path, save_to: Path) -> dict:
    record = Record()
    t = trainer(out, [record, checkpointing(save_to)])
    try:
        t.fit(model(), loader(), ckpt_path=str(ckpt_path))
    except ckpt_format.CheckpointError as err:
        return {"ok": False, "error": str(err)}
    state = t.strategy.lightning_module_state_dict()
    return {"ok": True, "train": record.train, "state": state}


def flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def resume_run(out: Path, rank: int) -> dict:
    resumed = fit_from(out, out / "ckpt" / "last.ckpt", out / "ckpt")
    reference = fit_from(out, out / "A", out / "ref_ckpt")
    result = {k: v for k, v in resumed.items() if k != "state"}
    result["reference_train"] = reference.get("train")
    if resumed["ok"] and reference["ok"]:
        a, b = resumed["state"], reference["state"]
        result["weights_equal"] = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
        result["files"] = sorted(os.listdir(out / "ckpt" / "last.ckpt"))
        result["listed"] = sorted([ckpt_format.MANIFEST] + [
            s["file"] for s in ckpt_format.read_manifest(out / "ckpt" / "last.ckpt")["shards"]
        ])
    torch.distributed.barrier()
    bad = out / "A" / ckpt_format.read_manifest(out / "A")["shards"][1]["file"]
    if rank == 0:
        flip_a_byte(bad)
    torch.distributed.barrier()
    corrupt = fit_from(out, out / "A", out / "corrupt_ckpt")
    result["corrupt"] = {"ok": corrupt["ok"], "error": corrupt.get("error"), "file": str(bad)}
    return result


def single_run(out: Path) -> dict:
    """One process: save every epoch over ``last.ckpt``, resume from the epoch-2 save, merge the shards."""
    full, resumed = Record(), Record()
    copy = out / "epoch2.ckpt"
    keep = CopyCommitted(out / "ckpt" / "last.ckpt", copy, step=STEP_B)
    trainer(out, [full, keep, checkpointing(out / "ckpt")], devices=1).fit(model(), loader())
    again = trainer(out, [resumed, checkpointing(out / "ckpt2")], devices=1)
    again.fit(model(), loader(), ckpt_path=str(copy))
    merged = load_pipeline_state_dict(out / "ckpt2" / "last.ckpt")
    own = again.strategy.lightning_module_state_dict()
    return {"full": full.train, "resumed": resumed.train,
            "merged_equal": sorted(merged) == sorted(own) and all(torch.equal(merged[k], own[k]) for k in own),
            "manifest": ckpt_format.read_manifest(out / "ckpt2" / "last.ckpt")}


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    if mode == "single":
        (out / "single.json").write_text(json.dumps(single_run(out)))
        return
    rank = int(os.environ["LOCAL_RANK"])
    if mode == "crash":
        crash_run(out, rank, sys.argv[3], int(sys.argv[4]))
        return  # the victim never gets here
    result = resume_run(out, rank)
    (out / f"resume_rank{rank}.json").write_text(json.dumps(result))
    # Leave together, and skip interpreter finalization: in about 1 run of 10, a gloo worker thread still
    # destroying an all_gather's work takes the GIL during finalization and aborts the process (rc -6,
    # "terminate called without an active exception") after everything here is done and written.
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
