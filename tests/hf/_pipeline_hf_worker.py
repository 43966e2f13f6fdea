"""One rank of the Hugging Face pipeline tests; the test process imports it for the single-process references.

    LOCAL_RANK=0 NODE_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python _pipeline_hf_worker.py OUT [ROUTER_AUX]

``ROUTER_AUX`` (default ``exact``) is passed to the strategy of every scenario (it matters for the MoE ones).
``python _pipeline_hf_worker.py OUT cuda`` instead runs one rank on one GPU (nccl): every family, fused or not,
against a plain single-GPU Trainer. ``python _pipeline_hf_worker.py OUT families`` (2 ranks) trains the families
of :data:`FAMILY_SCENARIOS` (Gemma2, Gemma3, Phi3, Qwen2-MoE, OLMoE, DeepSeek-V3) for :data:`FAMILY_STEPS` steps
each and writes ``OUT/families<r>.json``.

Every scenario trains ``lightning_memkit.demo.HFCausalLM`` (or, for the other families, :class:`FamilyLM`, the same
module over any :data:`~lightning_memkit.demo.hf_models.TINY_HF_FAMILIES` member; no pipeline methods) under
``strategy="memkit_pipeline"`` on 2 ranks and writes the logged losses to ``OUT/rank<r>.json``.
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
from torch.utils.data import DataLoader, Dataset

from lightning_memkit.demo import ByteTextDataModule, HFCausalLM
from lightning_memkit.demo.hf_models import tiny_hf_causal_lm

warnings.filterwarnings("ignore")
STEPS = 4
BATCH = 8
SEQ = 32


class Padded(Dataset):
    """Byte windows with left and right padding (``attention_mask`` 0, labels -100) on some rows."""

    def __init__(self, n: int = BATCH * STEPS, seed: int = 3):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 256, (n, SEQ), generator=g)
        self.pad = torch.randint(0, SEQ // 2, (n,), generator=g)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = torch.ones(SEQ, dtype=torch.int64)
        p = int(self.pad[i])
        if i % 2:
            mask[:p] = 0  # left padding
        else:
            mask[SEQ - p:] = 0  # right padding
        labels = self.ids[i].masked_fill(mask == 0, -100)
        return {"input_ids": self.ids[i], "attention_mask": mask, "labels": labels}


def model(family: str) -> HFCausalLM:
    """``llama_tied``: a Llama whose ``lm_head`` is its input embedding (``tie_word_embeddings``)."""
    tied = family == "llama_tied"
    return HFCausalLM(family="llama" if tied else family, hidden_size=32, num_layers=4, lr=1e-2, seed=0,
                      config_overrides={"tie_word_embeddings": True} if tied else None)


def data(kind: str) -> DataLoader:
    """``STEPS`` training batches: padded ones in one epoch, byte windows in 2 epochs of 2 (epoch-end resume)."""
    if kind == "padded":
        return DataLoader(Padded(), batch_size=BATCH)
    dm = ByteTextDataModule(batch_size=BATCH, seq_len=SEQ, samples_per_epoch=BATCH * 2, batch_format="hf")
    dm.setup("fit")
    return dm.train_dataloader()


def val_data() -> DataLoader:
    """One padded batch of 7: 4 microbatches of 2, 2, 2 and 1 rows in evaluation."""
    return DataLoader(Padded(7, seed=5), batch_size=7)


# family, data, strategy arguments
SCENARIOS = {
    "llama": ("llama", "bytes", {}),
    "qwen3_moe": ("qwen3_moe", "padded", {"schedule": "gpipe"}),
    "gpt_oss": ("gpt_oss", "padded", {"schedule": "dualpipev"}),
    "llama_fused": ("llama", "bytes", {"fused_loss": True}),
    "llama_tied": ("llama_tied", "bytes", {"schedule": "dualpipev"}),  # rank 0 holds the embedding and the head
}


class Record(Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def trainer(kind: str, callbacks, root: Path | None = None, **kwargs) -> pl.Trainer:
    epochs = 1 if kind == "padded" else 2  # STEPS training steps either way
    return pl.Trainer(**{"accelerator": "cpu", **kwargs}, max_epochs=epochs, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=bool(root), num_sanity_val_steps=0,
                      callbacks=callbacks, default_root_dir=root)


def reference(name: str) -> dict:
    """The same module, data and optimizer under a plain single-process Trainer; then the validation loss."""
    family, kind, _ = SCENARIOS[name]
    record = Record()
    fit = trainer(kind, [record], devices=1)
    fit.fit(model(family), data(kind))
    val = fit.validate(fit.lightning_module, val_data(), verbose=False)[0]["val_loss"]
    return {"losses": record.losses, "val": val}


ROUTER_AUX = ["exact"]


def pipeline(name: str, root: Path | None = None, callbacks=(), ckpt_path: str | None = None) -> dict:
    """2-rank fit (this process is one rank), then the validation loss of the same trainer."""
    from lightning_memkit.strategies import MemkitPipelineStrategy

    family, kind, args = SCENARIOS[name]
    record = Record()
    strategy = MemkitPipelineStrategy(**{"microbatches": 4, "timeout": 60, "router_aux": ROUTER_AUX[0], **args})
    fit = trainer(kind, [record, *callbacks], root, devices=2, strategy=strategy)
    module = model(family)
    fit.fit(module, data(kind), ckpt_path=ckpt_path)
    val = fit.validate(module, val_data(), verbose=False)[0]["val_loss"]  # the weights as trained
    return {"losses": record.losses, "val": val, "trainer": fit}


def checkpoint(out: Path) -> dict:
    """Fused llama with a checkpoint per epoch; resuming from the first gives the same last 2 losses."""
    full = pipeline("llama_fused", out, [ModelCheckpoint(dirpath=out / "ckpt", every_n_epochs=1, save_top_k=-1)])
    resumed = pipeline("llama_fused", out, [], ckpt_path=str(out / "ckpt" / "epoch=0-step=2.ckpt"))
    runtime, shape_error = full["trainer"].strategy.runtime, None
    ids = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    runtime.train_step((ids, torch.ones_like(ids)), ids)  # fixes the stages' shapes (a fresh runtime after validate)
    try:  # another sequence length is refused, on every rank, before anything is sent
        runtime.train_step((ids[:, 1:], torch.ones_like(ids[:, 1:])), ids[:, 1:])
    except ValueError as err:
        shape_error = str(err)
    return {"losses": full["losses"], "val": full["val"], "resumed": resumed["losses"], "shape_error": shape_error}


def cuda(out: Path) -> None:
    """One rank on one GPU, 4 microbatches: the pipeline's losses and a plain Trainer's, per family and loss."""
    from lightning_memkit.strategies import MemkitPipelineStrategy

    result = {}
    for family in ("llama", "qwen3_moe", "gpt_oss"):
        for fused in (False, True):
            runs = []
            for strategy in (MemkitPipelineStrategy(microbatches=4, fused_loss=fused, timeout=120), "auto"):
                record = Record()
                fit = trainer("padded", [record], accelerator="gpu", devices=1, strategy=strategy)
                fit.fit(model(family), data("padded"))
                runs.append(record.losses)
            result[f"{family}{'_fused' if fused else ''}"] = runs
    (out / "cuda.json").write_text(json.dumps(result))


# -- the other families: 3 steps each on padded batches ------------------------------------------------------
FAMILY_STEPS = 3

# name: family, strategy arguments (every one on padded batches of BATCH x SEQ, 4 microbatches of 2 rows); the
# Gemmas and Phi3 get sliding windows of 8 tokens (SEQ is 32)
FAMILY_SCENARIOS = {
    "gemma2": ("gemma2", {"schedule": "dualpipev"}),  # tied embedding and head both on rank 0, logit softcap
    "gemma2_fused": ("gemma2", {"fused_loss": True}),  # 1F1B: tie across the ranks, softcap in the fused loss
    "gemma3_text": ("gemma3_text", {}),  # local and global rotary pairs carried, sliding and full layers
    "phi3": ("phi3", {"schedule": "gpipe"}),  # every layer sliding (config.sliding_window, no layer_types)
    "qwen2_moe": ("qwen2_moe", {}),  # shared expert, a dense first layer, router aux loss
    "olmoe": ("olmoe", {"partition": "uniform"}),  # router aux loss, an even split of the layers
    "deepseek_v3": ("deepseek_v3", {"schedule": "dualpipev"}),  # MLA, a dense first layer, MoE (no aux loss)
}
WINDOWS = {"gemma2": 8, "gemma3_text": 8, "phi3": 8}


class FamilyLM(pl.LightningModule):
    """``HFCausalLM`` for any tiny family: hidden 64, 4 layers, AdamW at 1e-2, the model's own loss."""

    def __init__(self, family: str):
        super().__init__()
        window = {"sliding_window": WINDOWS[family]} if family in WINDOWS else {}
        self.model = tiny_hf_causal_lm(family, seed=0, hidden_size=64, num_layers=4, **window)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def family_fit(name: str, **kwargs) -> dict:
    """``FAMILY_STEPS`` steps of scenario ``name`` (2 ranks under the strategy, or one plain process), then the
    validation loss of a padded batch of 7 rows."""
    family, _ = FAMILY_SCENARIOS[name]
    record = Record()
    fit = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                     callbacks=[record], **kwargs)
    module = FamilyLM(family)
    fit.fit(module, DataLoader(Padded(BATCH * FAMILY_STEPS), batch_size=BATCH))
    val = fit.validate(module, val_data(), verbose=False)[0]["val_loss"]
    return {"losses": record.losses, "val": val}


def family_reference(name: str) -> dict:
    """A plain single-process Trainer on the same module, data and optimizer."""
    return family_fit(name, devices=1)


def families(out: Path, rank: int) -> None:
    from lightning_memkit.strategies import MemkitPipelineStrategy

    result = {}
    for name, (_, args) in FAMILY_SCENARIOS.items():
        strategy = MemkitPipelineStrategy(**{"microbatches": 4, "timeout": 60, **args})
        result[name] = family_fit(name, devices=2, strategy=strategy)
    (out / f"families{rank}.json").write_text(json.dumps(result))


def main() -> None:
    out = Path(sys.argv[1])
    if sys.argv[2:] == ["cuda"]:
        cuda(out)
        return
    if sys.argv[2:] == ["families"]:
        torch.set_num_threads(1)
        families(out, int(os.environ["LOCAL_RANK"]))
        return
    ROUTER_AUX[0] = sys.argv[2] if len(sys.argv) > 2 else "exact"
    rank = int(os.environ["LOCAL_RANK"])
    torch.set_num_threads(1)
    result = {}
    for name in ("llama", "qwen3_moe", "gpt_oss", "llama_tied"):
        run = pipeline(name)
        result[name] = {"losses": run["losses"], "val": run["val"]}
    SCENARIOS["llama_tied_1f1b"] = ("llama_tied", "bytes", {})  # 1F1B: the tied embedding and head on two ranks
    run = pipeline("llama_tied_1f1b")
    result["llama_tied_1f1b"] = {"losses": run["losses"], "val": run["val"]}
    result["checkpoint"] = checkpoint(out)
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
