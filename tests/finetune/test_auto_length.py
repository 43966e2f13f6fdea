"""``TextDataModule(max_length="auto")``: the data's own limit (the longest block that still makes a batch when
packing, the longest document otherwise); ``MemoryBudget`` trains at the longest length its budget fits, says it in
one line, and a resumed run keeps the checkpoint's length (the rows cut as before) whatever the budget now."""

import json
import logging
import warnings

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

pytest.importorskip("datasets")

from lightning_memkit.callbacks import MemoryBudget  # noqa: E402
from lightning_memkit.demo.hf_models import tiny_hf_causal_lm  # noqa: E402
from lightning_memkit.estimate.plans import strongest_fits  # noqa: E402
from lightning_memkit.finetune import PretrainedCausalLM  # noqa: E402
from lightning_memkit.finetune.text_data import TextDataModule, train_tokenizer  # noqa: E402
from lightning_memkit.memory import LivePeak  # noqa: E402

FOX = "the quick brown fox jumps over the lazy dog "
DOCS = [f"record {i}: {FOX * (1 + i % 7)}number {i * 13}" for i in range(400)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("auto_length")
    train_tokenizer(DOCS, root / "tokenizer")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    vocab = len(AutoTokenizer.from_pretrained(str(root / "tokenizer")))
    tiny_hf_causal_lm("llama", seed=0, vocab_size=vocab, hidden_size=64, num_layers=2).save_pretrained(root / "base")
    return root


def _data(files, **kwargs):
    args = {"max_length": "auto", "batch_size": 2, "val_fraction": 0.0, **kwargs}
    return TextDataModule(str(files / "docs.jsonl"), tokenizer=str(files / "tokenizer"), **args)


@pytest.mark.parametrize("packing", [True, False])
def test_the_data_limit_is_the_longest_row_the_data_can_fill(files, packing):
    data = _data(files, packing=packing, val_fraction=0.1)
    data.setup("fit")
    limit = data.auto_length_limit()
    if packing:  # at the limit a training batch of blocks, one token more: none
        data.set_max_length(limit)
        assert len(data.train_set) >= 2 and all(len(r) == limit for r in data.train_set["input_ids"])
        with pytest.raises(ValueError, match="fewer than one batch"):
            _data(files, packing=True, val_fraction=0.1, max_length=limit + 1).setup("fit")
    else:
        lengths = [len(ids) for ids in data._documents["input_ids"]]
        assert limit == max(lengths)
    assert data.auto_length_limit() is None or not packing


def test_an_open_length_without_memory_budget_is_one_line(files):
    data = _data(files)
    data.setup("fit")
    with pytest.raises(ValueError, match=r"max_length='auto'\): no length chosen yet: put MemoryBudget"):
        data.train_dataloader()
    with pytest.raises(ValueError, match="max_length"):
        _data(files, max_length="longest")


class _Rows(Callback):
    def __init__(self):
        self.batches, self.losses = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append(batch["input_ids"].tolist())
        self.losses.append(float(outputs["loss"]))


def _fit(files, budget, max_steps, dirpath, ckpt_path=None):
    torch.manual_seed(0)
    model = PretrainedCausalLM(str(files / "base"), dtype="float32", lr=1e-2)
    data = _data(files)
    rows, planner = _Rows(), MemoryBudget(budget)
    with warnings.catch_warnings(), LivePeak() as live:
        warnings.simplefilter("ignore")
        trainer = Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0,
                          callbacks=[rows, planner, ModelCheckpoint(dirpath=dirpath, save_last=True,
                                                                    every_n_train_steps=2)])
        trainer.fit(model, data, ckpt_path=ckpt_path)
    return rows, planner, trainer, data, live.peak_bytes


@pytest.mark.slow  # the fast suite runs the same fit in docs/long_context.md's example
def test_memory_budget_trains_at_the_longest_length_that_fits(files, tmp_path, caplog):
    """At 24 MiB the tiny Llama's longest length is below what the data and the model allow: the fit trains at it
    (every row), says it, stays within the budget; its strongest plan fits there and not 128 tokens further."""
    caplog.set_level(logging.INFO, logger="lightning_memkit")
    budget = 24 * 2**20
    rows, planner, trainer, data, peak = _fit(files, budget, 3, tmp_path / "run")
    length = planner.max_length
    assert f"max_length='auto': training at {length:,} tokens per row" in caplog.text
    data_limit = _data(files)
    data_limit.setup("fit")
    assert 128 <= length < data_limit.auto_length_limit()  # the budget, not the data, set it
    assert all(len(r) == length for b in rows.batches for r in b)

    def fits(tokens):
        run = planner._run(trainer, trainer.lightning_module, data.batch_at(tokens), planner.allow, quiet=True)
        return strongest_fits(run, planner.budget_bytes, margin=planner.margin)[0]

    assert fits(length) and not fits(length + 128)
    assert peak <= budget


@pytest.mark.slow
def test_a_resume_keeps_the_checkpoints_length_whatever_the_budget_now(files, tmp_path, caplog):
    """Stopped after step 3 (its last checkpoint: step 2), resumed with twice the budget (which fits the model's
    4,096 positions): the checkpoint's length, and the batches and losses of the run that never stopped."""
    caplog.set_level(logging.INFO, logger="lightning_memkit")
    budget = 24 * 2**20
    _, planner, *_ = _fit(files, budget, 3, tmp_path / "run")
    length = planner.max_length
    straight, *_ = _fit(files, budget, 5, tmp_path / "straight")
    resumed, again, *_ = _fit(files, 2 * budget, 5, tmp_path / "run", ckpt_path="last")
    assert again.max_length == length and "as the checkpoint's run chose" in caplog.text
    assert resumed.batches == straight.batches[2:] and resumed.losses == straight.losses[2:]


def test_memkit_estimate_of_a_config_with_an_open_length_is_one_line(files, tmp_path):
    from lightning_memkit.common.errors import ConfigError
    from lightning_memkit.estimate.config import estimate_from_config

    config = tmp_path / "run.yaml"
    config.write_text(f"""
trainer: {{accelerator: cpu, max_steps: 1}}
model:
  class_path: lightning_memkit.finetune.PretrainedCausalLM
  init_args: {{model: {files / "base"}, dtype: float32}}
data:
  class_path: lightning_memkit.finetune.TextDataModule
  init_args: {{path: {files / "docs.jsonl"}, tokenizer: {files / "tokenizer"}, max_length: auto, batch_size: 2}}
""")
    with pytest.raises(ConfigError, match=r"max_length is 'auto'.*--data.init_args.max_length N \(the data allows"):
        estimate_from_config(config)
