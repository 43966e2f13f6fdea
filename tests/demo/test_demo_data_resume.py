"""The demo data modules resume mid-epoch: a fit killed after step 5 of a 10-batch epoch (its last checkpoint: step
4) and resumed from that checkpoint by a new Trainer sees the rest of epoch 0 in its order, then epoch 1, with the
losses of the fit that never stopped (the training loaders are torchdata's ``StatefulDataLoader``); one resumed from
the checkpoint of an epoch's last batch begins the next epoch (not an empty one); and the loaders give the batches
the plain ``DataLoader`` of before gave."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_memkit.demo import ByteTextDataModule, HFCausalLM, TinyLM, VariableLengthDataModule
from lightning_memkit.demo.variable_text import pad_hf

PER_EPOCH, KILL_AT, STEPS = 10, 5, 14  # the fits run into epoch 1


def _bytes(**kwargs) -> ByteTextDataModule:
    return ByteTextDataModule(batch_size=4, seq_len=16, max_bytes=20_000, samples_per_epoch=4 * PER_EPOCH, **kwargs)


def _variable(**kwargs) -> VariableLengthDataModule:
    return VariableLengthDataModule(batch_size=4, lengths=(16, 40), batches=PER_EPOCH, max_bytes=20_000, **kwargs)


def _inputs(batch) -> torch.Tensor:
    return batch["input_ids"] if isinstance(batch, dict) else batch[0]


class _Killed(Exception):
    pass


class _Record(Callback):
    """``(global step, epoch, batch index, input ids, loss)`` of every step; raises (a killed run) after step
    ``kill_at``, before a checkpoint could hold it."""

    def __init__(self, kill_at: int | None = None):
        self.kill_at, self.steps = kill_at, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append((trainer.global_step, trainer.current_epoch, batch_idx, _inputs(batch).tolist(),
                           float(outputs["loss"])))
        if trainer.global_step == self.kill_at:
            raise _Killed


def _fit(model_and_data, dirpath, kill_at=None, ckpt_path=None) -> list[tuple]:
    pl.seed_everything(0, verbose=False)
    model, data = model_and_data()
    record = _Record(kill_at)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(accelerator="cpu", max_steps=STEPS, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                             callbacks=[record, ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2,
                                                                save_top_k=-1)])
        if kill_at is None:
            trainer.fit(model, data, ckpt_path=ckpt_path)
        else:
            with pytest.raises(_Killed):
                trainer.fit(model, data)
    return record.steps


def _without_losses(steps):
    return [s[:4] for s in steps]


def _losses(steps):
    return [s[4] for s in steps]


def _killed_and_resumed(model_and_data, tmp_path) -> tuple[list, list, list]:
    straight = _fit(model_and_data, tmp_path / "straight")
    killed = _fit(model_and_data, tmp_path / "run", kill_at=KILL_AT)
    saved = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert saved == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]  # step 5 lost, as in a killed run
    resumed = _fit(model_and_data, tmp_path / "run", ckpt_path=str(tmp_path / "run" / "epoch=0-step=4.ckpt"))
    return straight, killed, resumed


def _assert_resumed_at_epoch_end(model_and_data, tmp_path, straight):
    """From the straight fit's checkpoint of epoch 0's last batch: epoch 1 from its first batch, as if never stopped."""
    resumed = _fit(model_and_data, tmp_path / "end", ckpt_path=str(tmp_path / "straight" / "epoch=0-step=10.ckpt"))
    assert _without_losses(resumed) == _without_losses(straight[PER_EPOCH:])
    assert _losses(resumed) == pytest.approx(_losses(straight[PER_EPOCH:]), abs=1e-6)


def _assert_epoch_zero_whole(straight, killed, resumed):
    """The batches of epoch 0 that the killed fit trained on (steps 1-4, its last checkpoint) and the resumed fit's
    are the straight fit's epoch 0: each batch once, in order."""
    assert [(s[0], s[1], s[2]) for s in straight[:PER_EPOCH]] == [(i + 1, 0, i) for i in range(PER_EPOCH)]
    stitched = killed[:KILL_AT - 1] + [s for s in resumed if s[1] == 0]
    assert _without_losses(stitched) == _without_losses(straight[:PER_EPOCH])
    assert _without_losses(killed) == _without_losses(straight[:KILL_AT])
    assert _losses(killed) == pytest.approx(_losses(straight[:KILL_AT]), abs=1e-6)


def _tiny_lm_on_bytes():
    return TinyLM(d_model=32, n_layers=1, n_heads=2, seq_len=16, lr=1e-2), _bytes()


def _llama_on_variable(shuffle=False):
    return HFCausalLM(family="llama", hidden_size=64, num_layers=1, vocab_size=256), _variable(shuffle=shuffle)


def test_byte_text_resumed_mid_epoch_sees_the_batches_and_losses_of_the_fit_that_never_stopped(tmp_path):
    straight, killed, resumed = _killed_and_resumed(_tiny_lm_on_bytes, tmp_path)
    assert [s[1] for s in straight] == [0] * PER_EPOCH + [1] * (STEPS - PER_EPOCH)
    assert _without_losses(resumed) == _without_losses(straight[KILL_AT - 1:])
    assert _losses(resumed) == pytest.approx(_losses(straight[KILL_AT - 1:]), abs=1e-6)
    _assert_epoch_zero_whole(straight, killed, resumed)
    _assert_resumed_at_epoch_end(_tiny_lm_on_bytes, tmp_path, straight)
    data = _bytes()
    data.setup("fit")
    assert [s[3] for s in straight[:PER_EPOCH]] == [x.tolist() for x, _ in data.train_dataloader()]


def test_variable_length_resumed_mid_epoch_sees_the_batches_and_losses_of_the_fit_that_never_stopped(tmp_path):
    straight, killed, resumed = _killed_and_resumed(_llama_on_variable, tmp_path)
    assert [s[1] for s in straight] == [0] * PER_EPOCH + [1] * (STEPS - PER_EPOCH)
    assert [len(s[3][0]) for s in straight[:2]] == [16, 40]  # the lengths in turn
    assert _without_losses(resumed) == _without_losses(straight[KILL_AT - 1:])
    assert _losses(resumed) == pytest.approx(_losses(straight[KILL_AT - 1:]), abs=1e-6)
    _assert_epoch_zero_whole(straight, killed, resumed)
    _assert_resumed_at_epoch_end(_llama_on_variable, tmp_path, straight)


def test_variable_length_shuffled_resumed_mid_epoch_finishes_the_epoch_in_its_order(tmp_path):
    """Shuffled, each epoch's order is drawn from the global RNG as it starts (as a shuffled ``DataLoader`` draws it):
    the interrupted epoch is finished in its order; the later ones follow the global RNG, which Lightning does not
    checkpoint, so only their content is checked."""
    straight, killed, resumed = _killed_and_resumed(lambda: _llama_on_variable(shuffle=True), tmp_path)
    ordered = _fit(_llama_on_variable, tmp_path / "ordered")
    assert _without_losses(straight[:PER_EPOCH]) != _without_losses(ordered[:PER_EPOCH])  # shuffled
    rest = PER_EPOCH - KILL_AT + 1
    assert _without_losses(resumed[:rest]) == _without_losses(straight[KILL_AT - 1:PER_EPOCH])
    assert _losses(resumed[:rest]) == pytest.approx(_losses(straight[KILL_AT - 1:PER_EPOCH]), abs=1e-6)
    _assert_epoch_zero_whole(straight, killed, resumed)
    assert [(s[0], s[1]) for s in resumed[rest:]] == [(PER_EPOCH + i + 1, 1) for i in range(STEPS - PER_EPOCH)]


def _epochs(loader, epochs=2) -> list[list]:
    return [[[t.tolist() for t in (b.values() if isinstance(b, dict) else b)] for b in loader] for _ in range(epochs)]


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_variable_length_loader_gives_the_batches_of_a_plain_data_loader(shuffle):
    data = _variable(shuffle=shuffle)
    data.setup("fit")
    runs = []
    for make in (lambda: DataLoader(data.train_set, batch_size=4, shuffle=shuffle, collate_fn=pad_hf),
                 data.train_dataloader):
        torch.manual_seed(7)
        runs.append((_epochs(make()), torch.rand(1).item()))  # the same batches, the global RNG drawn alike
    assert runs[0] == runs[1] and len(runs[0][0][0]) == PER_EPOCH
    assert isinstance(data.train_dataloader(), StatefulDataLoader)


def test_byte_text_loader_gives_the_batches_of_a_plain_data_loader():
    for kwargs in ({}, {"batch_format": "hf"}):
        data = ByteTextDataModule(batch_size=4, seq_len=16, max_bytes=20_000, samples_per_epoch=4 * PER_EPOCH + 3,
                                  **kwargs)
        data.setup("fit")
        plain = DataLoader(data.train_set, batch_size=4, shuffle=False, drop_last=True)
        assert _epochs(data.train_dataloader()) == _epochs(plain)
        assert len(data.train_dataloader()) == PER_EPOCH  # the partial batch dropped
        assert isinstance(data.train_dataloader(), StatefulDataLoader)
