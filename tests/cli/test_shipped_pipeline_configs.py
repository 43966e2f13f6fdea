"""The shipped pipeline configs: every subcommand on 2 gloo ranks (a process per subcommand: Lightning launches the
ranks by running the command again), and predictions that agree with one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from shipped_configs import CONFIGS, PIPELINES, SHORT, check_output, memkit, short_args


@pytest.mark.slow
@pytest.mark.parametrize("config", PIPELINES)
def test_every_subcommand_runs_every_shipped_pipeline_config(tmp_path: Path, config: str) -> None:
    for subcommand in SHORT:
        proc = memkit(*short_args(subcommand, config, tmp_path))
        assert proc.returncode == 0, f"{subcommand}: {proc.stderr[-3000:]}"
        check_output(subcommand, config, proc.stdout)


SAVE_PREDICTIONS = """
import torch
from lightning.pytorch.callbacks import Callback


class SavePredictions(Callback):
    def __init__(self, path: str):
        self.path, self.outputs = path, []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.outputs.append(outputs)

    def on_predict_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            torch.save(self.outputs, self.path)
"""


@pytest.mark.slow
def test_pipeline_predict_agrees_with_one_process(tmp_path):
    (tmp_path / "save_predictions.py").write_text(SAVE_PREDICTIONS)
    common = ["predict", "--config", str(CONFIGS / "tiny_lm_pipeline.yaml"), "--trainer.logger", "false",
              "--trainer.enable_progress_bar", "false", "--trainer.limit_predict_batches", "2",
              "--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks+=save_predictions.SavePredictions"]
    env_cwd = tmp_path  # save_predictions is importable from the working directory
    piped = memkit(*common, f"--trainer.callbacks.path={tmp_path / 'pipe.pt'}", cwd=env_cwd)
    assert piped.returncode == 0, piped.stderr[-3000:]
    single = memkit(*common, f"--trainer.callbacks.path={tmp_path / 'one.pt'}", "--trainer.strategy", "auto",
                    "--trainer.devices", "1", cwd=env_cwd)
    assert single.returncode == 0, single.stderr[-3000:]
    logits, tokens = torch.load(tmp_path / "pipe.pt"), torch.load(tmp_path / "one.pt")
    assert [t.shape for t in logits] == [(32, 128, 256)] * 2 and [t.shape for t in tokens] == [(32, 128)] * 2
    agree = torch.cat([(lg.argmax(-1) == tk).flatten() for lg, tk in zip(logits, tokens)]).float().mean()
    assert agree > 0.999  # same weights (seed 0), same batches: the same greedy bytes up to float ties
