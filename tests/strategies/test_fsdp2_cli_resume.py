"""``memkit fit --ckpt_path last`` under ``strategy: memkit_fsdp2`` on 2 CPU ranks with a CSV logger: a run stopped
mid-epoch at step 4 (its sharded ``last.ckpt`` a folder in ``version_0``) resumes in ``version_1`` at step 4 and logs
the uninterrupted run's losses for steps 4 and 5, bit for bit: no step skipped, repeated or restarted."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

CONFIG = """\
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 2
  strategy: memkit_fsdp2
  max_steps: 6
  default_root_dir: {root}
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {{save_dir: {root}}}
  callbacks:
  - class_path: lightning.pytorch.callbacks.ModelCheckpoint
    init_args: {{save_last: true, every_n_train_steps: 2}}
  enable_progress_bar: false
  enable_model_summary: false
  log_every_n_steps: 1
model:
  class_path: lightning_memkit.demo.HFCausalLM
  init_args: {{family: llama, hidden_size: 64, num_layers: 2}}
data:
  class_path: lightning_memkit.demo.ByteTextDataModule
  init_args: {{batch_size: 4, seq_len: 32, batch_format: hf}}
"""


def memkit_fit(config: Path, *args: str) -> None:
    memkit = Path(sys.executable).with_name("memkit")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([str(memkit), "fit", "--config", str(config), *args], cwd=config.parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def losses(root: Path, version: int) -> dict[int, str]:
    with open(root / "lightning_logs" / f"version_{version}" / "metrics.csv") as f:
        return {int(row["step"]): row["train_loss"] for row in csv.DictReader(f) if row.get("train_loss")}


@pytest.mark.slow
def test_a_sharded_run_resumes_with_ckpt_path_last_where_it_stopped(tmp_path):
    for name in ("stopped", "whole"):
        root = tmp_path / name
        root.mkdir()
        (root / "config.yaml").write_text(CONFIG.format(root=root / "runs"))
    stopped = tmp_path / "stopped"
    memkit_fit(stopped / "config.yaml", "--trainer.max_steps", "4")
    assert (stopped / "runs/lightning_logs/version_0/checkpoints/last.ckpt/.metadata").is_file()  # sharded: a folder
    memkit_fit(stopped / "config.yaml", "--ckpt_path", "last")
    memkit_fit(tmp_path / "whole" / "config.yaml")
    whole = losses(tmp_path / "whole" / "runs", 0)
    assert sorted(whole) == list(range(6))
    assert losses(stopped / "runs", 0) == {s: whole[s] for s in range(4)}
    assert losses(stopped / "runs", 1) == {4: whole[4], 5: whole[5]}


def test_the_last_checkpoint_may_be_a_sharded_folder(tmp_path):
    """A sharded ``last.ckpt`` (a folder with ``.metadata``) is found; a folder without it (a save cut short) is not a
    checkpoint."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lightning_memkit.config.resume import last_checkpoint

    for version, complete in ((0, True), (1, False)):
        folder = tmp_path / "lightning_logs" / f"version_{version}" / "checkpoints" / "last.ckpt"
        folder.mkdir(parents=True)
        (folder / ("__0_0.distcp")).write_bytes(b"")
        if complete:
            (folder / ".metadata").write_bytes(b"")
    trainer = Trainer(logger=CSVLogger(tmp_path), callbacks=[ModelCheckpoint(save_last=True)])
    assert last_checkpoint(trainer) == tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
