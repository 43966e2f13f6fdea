"""TextDataModule: your text files through ``datasets``, tokenized with a tokenizer trained here, packed or padded,
the longest batch declared, and a run resumed mid-epoch with the losses of the run that never stopped."""

import json
import warnings

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

pytest.importorskip("datasets")

from lightning_memkit.demo.hf_models import tiny_hf_causal_lm  # noqa: E402
from lightning_memkit.finetune import PretrainedCausalLM  # noqa: E402
from lightning_memkit.finetune.text_data import TextDataModule, train_tokenizer  # noqa: E402

DOCS = [f"note {i}: the quick brown fox {'jumps over ' * (i % 5)}the lazy dog number {i * 7}" for i in range(120)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import datasets

    root = tmp_path_factory.mktemp("text")
    train_tokenizer(DOCS, root / "tokenizer")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    (root / "docs.txt").write_text("\n".join(DOCS) + "\n")
    table = datasets.Dataset.from_dict({"text": DOCS})
    table.to_parquet(str(root / "docs.parquet"))
    table.save_to_disk(str(root / "saved"))
    return root


def _module(files, name, **kwargs):
    args = {"max_length": 32, "batch_size": 4, "val_fraction": 0.1, **kwargs}
    data = TextDataModule(str(files / name), tokenizer=str(files / "tokenizer"), **args)
    data.setup("fit")
    return data


def test_every_format_gives_the_same_rows(files):
    rows = {name: [r.tolist() for r in _module(files, name).train_set["input_ids"]]
            for name in ("docs.jsonl", "docs.txt", "docs.parquet", "saved")}
    assert len(rows["docs.jsonl"]) > 10 and all(r == rows["docs.jsonl"] for r in rows.values())


def test_packed_rows_are_full_blocks_and_padded_rows_mask_their_padding(files):
    packed = _module(files, "docs.jsonl")
    batch = next(iter(packed.train_dataloader()))
    assert batch["input_ids"].shape == (4, 32) and torch.equal(batch["labels"], batch["input_ids"])
    padded = _module(files, "docs.jsonl", packing=False, max_length=64)
    batch = next(iter(padded.train_dataloader()))
    pad = batch["attention_mask"] == 0
    assert batch["input_ids"].shape[1] <= 64 and pad.any()
    assert torch.all(batch["labels"][pad] == -100) and torch.equal(batch["labels"][~pad], batch["input_ids"][~pad])
    assert padded.longest_batch()["input_ids"].shape == (4, 64)


def test_bad_input_names_the_argument(files, tmp_path):
    with pytest.raises(ValueError, match=r"text_field='body'\): the data has the columns \['text'\]"):
        _module(files, "docs.parquet", text_field="body")  # a JSONL's records are checked as it is built (below)
    (tmp_path / "x.csv").write_text("a\n")
    with pytest.raises(ValueError, match=r"path='.*x.csv'\): give a .jsonl, .json, .parquet, .txt file"):
        TextDataModule(str(tmp_path / "x.csv"), tokenizer=str(files / "tokenizer"))
    with pytest.raises(ValueError, match="max_length"):
        TextDataModule(str(files / "docs.jsonl"), tokenizer=str(files / "tokenizer"), max_length=0)


@pytest.mark.parametrize("name, content, message", [
    ("empty.jsonl", b"\n\n", r"path='.*empty.jsonl'\): the file holds no text$"),
    ("latin.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"latin.jsonl'\): line 2 is not UTF-8 text \(invalid "),
    ("broken.jsonl", b'{"text": "ok"}\n{"text": \n', r"broken.jsonl'\): line 2 is not JSON"),
    ("body.jsonl", b'{"text": "ok"}\n{"body": "no"}\n', r"text_field='text'\): line 2 of '.*body.jsonl' has no 'text' "
                                                          r"\(it has \['body'\]\)"),
    ("empty.txt", b"", r"empty.txt'\): the file holds no text"),
])
def test_a_bad_text_file_is_one_line_when_the_module_is_built(files, tmp_path, name, content, message):
    """Checked when the config is parsed, before any model is loaded: the file's line, not datasets' traceback."""
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        TextDataModule(str(tmp_path / name), tokenizer=str(files / "tokenizer"))


def test_a_missing_tokenizer_folder_is_one_line(files, tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer='/no/such/models/tok'\): no such folder"):
        TextDataModule(str(files / "docs.jsonl"), tokenizer="/no/such/models/tok")
    TextDataModule(str(files / "docs.jsonl"), tokenizer="org/model")  # a hub name: looked up when the data is set up


class _Losses(Callback):
    def __init__(self):
        self.losses, self.batches = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.batches.append((trainer.current_epoch, batch["input_ids"].tolist()))


def _fit(files, base, max_steps, dirpath, ckpt_path=None):
    torch.manual_seed(0)
    model = PretrainedCausalLM(str(base), dtype="float32", lr=1e-2)
    data = TextDataModule(str(files / "small.jsonl"), tokenizer=str(files / "tokenizer"), max_length=32,
                          batch_size=4, val_fraction=0.0, seed=3)
    losses = _Losses()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0,
                          callbacks=[losses, ModelCheckpoint(dirpath=dirpath, save_last=True, every_n_train_steps=2,
                                                             save_top_k=-1)])
        trainer.fit(model, data, ckpt_path=ckpt_path)
    return losses, trainer.num_training_batches


def test_a_run_resumed_mid_epoch_sees_the_batches_it_would_have_seen(files, tmp_path):
    """Killed after step 5 of a 6-batch epoch (its last checkpoint: step 4), resumed: the rest of epoch 0 in its
    order, then epoch 1, with the losses of the run that never stopped (the training loader is stateful); resumed
    from the step-6 checkpoint (the epoch's last batch): epoch 1."""
    from transformers import AutoTokenizer

    (files / "small.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:11]))
    base = tmp_path / "base"
    vocab = len(AutoTokenizer.from_pretrained(str(files / "tokenizer")))
    tiny_hf_causal_lm("llama", seed=0, vocab_size=vocab).save_pretrained(base)
    straight, epoch = _fit(files, base, 9, tmp_path / "straight")
    assert epoch == 6  # 11 documents: 6 batches of 4 x 32 tokens per epoch
    first, _ = _fit(files, base, 5, tmp_path / "run")  # its last checkpoint: after step 4
    rest, _ = _fit(files, base, 9, tmp_path / "run", ckpt_path="last")
    assert [e for e, _ in straight.batches] == [0] * 6 + [1] * 3
    assert rest.batches == straight.batches[4:] and rest.losses == straight.losses[4:]
    # resumed from the checkpoint of the epoch's last batch: epoch 1 from its start, not an empty epoch
    at_end = next((tmp_path / "straight").glob("*step=6*.ckpt"))
    after, _ = _fit(files, base, 9, tmp_path / "end", ckpt_path=at_end)
    assert after.batches == straight.batches[6:] and after.losses == straight.losses[6:]
