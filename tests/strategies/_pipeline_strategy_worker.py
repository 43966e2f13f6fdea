"""One rank of the Lightning-level pipeline tests. Run by tests/strategies/test_pipeline.py.

    LOCAL_RANK=0 NODE_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python _pipeline_strategy_worker.py OUT
"""

from __future__ import annotations

import json
import os
import socket
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit.demo import TinyLM
from lightning_memkit.pipeline.writer_lock import LOCK_FILE
from lightning_memkit.strategies import MemkitPipelineStrategy, load_pipeline_state_dict

warnings.filterwarnings("ignore")
WORLD = 2
SEQ = 8


def model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(d_model=16, n_layers=2, n_heads=2, seq_len=SEQ, lr=1e-2)


def loaders(batch: int = 8, n: int = 24) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (n + batch, SEQ + 1), generator=g)
    train = TensorDataset(tokens[:n, :-1], tokens[:n, 1:])
    val = TensorDataset(tokens[n:, :-1], tokens[n:, 1:])
    return DataLoader(train, batch_size=batch), DataLoader(val, batch_size=batch)


class Record(Callback):
    def __init__(self):
        self.train, self.val = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append(float(outputs["loss"]))

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val.append(float(trainer.callback_metrics["val_loss"]))


def trainer(out: Path, callbacks, **strategy) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=WORLD, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=1, callbacks=callbacks, default_root_dir=out,
        strategy=MemkitPipelineStrategy(**{"microbatches": 4, "timeout": 60, **strategy}),
    )


def reference(epochs: int = 2) -> dict:
    """The same TinyLM trained in this process with its own optimizer, no pipeline."""
    lm = model()
    opt = lm.configure_optimizers()
    train, val = loaders()
    losses, vals = [], []
    for _ in range(epochs):
        for x, y in train:
            loss = lm.pipeline_loss(lm(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        with torch.no_grad():
            x, y = next(iter(val))
            vals.append(float(lm.pipeline_loss(lm(x), y)))
    return {"train": losses, "val": vals}


def errors(out: Path) -> dict:
    """Each bad input fails on every rank with a clear message (and nothing hangs)."""
    found = {}

    class NoProtocol(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

    class OneLayer(TinyLM):
        def pipeline_layers(self):
            return torch.nn.ModuleList([torch.nn.Sequential(*super().pipeline_layers())])

    train, val = loaders()
    odd, _ = loaders(batch=6)
    saved = str(out / "ckpt" / "epoch=0-step=3.ckpt")
    locked = out / "locked"
    cases = {
        "protocol": (NoProtocol(), train, None, []),
        "stages": (OneLayer(d_model=16, n_layers=1, n_heads=2, seq_len=SEQ), train, None, []),
        "batch": (model(), odd, None, []),
        "layers": (TinyLM(d_model=16, n_layers=3, n_heads=2, seq_len=SEQ), train, saved, []),
        "width": (TinyLM(d_model=32, n_layers=2, n_heads=2, seq_len=SEQ), train, saved, []),
        "locked": (model(), train, None, [ModelCheckpoint(dirpath=locked, every_n_epochs=1)]),
    }
    if int(os.environ["LOCAL_RANK"]) == 0:  # another live run (the test process itself) holds `locked`
        locked.mkdir()
        parent = int(os.environ["TEST_PID"])
        start = Path(f"/proc/{parent}/stat").read_text().rpartition(")")[2].split()[19]
        (locked / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": parent, "start": start,
                                                    "run_id": "other-run", "since": "earlier"}))
    for name, (module, data, ckpt_path, callbacks) in cases.items():
        try:
            trainer(out / name, callbacks).fit(module, data, val, ckpt_path=ckpt_path)
        except Exception as err:  # noqa: BLE001 - the error is the result
            found[name] = f"{type(err).__name__}: {err}"
        else:
            found[name] = None
    found["locked_files"] = sorted(os.listdir(locked))
    return found


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["LOCAL_RANK"])
    result = {}
    record = Record()
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", save_top_k=-1, every_n_epochs=1)
    train, val = loaders()
    first = trainer(out, [record, ckpt])
    first.fit(model(), train, val)
    result["partition"] = list(first.strategy.partition.sizes)
    result["full"] = {"train": list(record.train), "val": list(record.val)}
    result["validate"] = first.validate(dataloaders=val, verbose=False)[0]["val_loss"]  # same trainer, after fit
    resumed = Record()
    ckpt_b = ModelCheckpoint(dirpath=out / "ckpt_resumed", save_top_k=-1, every_n_epochs=1)
    second = trainer(out, [resumed, ckpt_b])
    second.fit(model(), train, val, ckpt_path=str(out / "ckpt" / "epoch=0-step=3.ckpt"))
    result["resumed"] = {"train": resumed.train, "val": resumed.val}
    result["errors"] = errors(out)
    if rank == 0:
        result["reference"] = reference()
        a = load_pipeline_state_dict(out / "ckpt" / "epoch=1-step=6.ckpt")
        b = load_pipeline_state_dict(out / "ckpt_resumed" / "epoch=1-step=6.ckpt")
        full = model().state_dict()
        result["state_keys_match"] = sorted(a) == sorted(full) == sorted(b)
        result["state_equal"] = all(torch.equal(a[k], b[k]) for k in a)
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
