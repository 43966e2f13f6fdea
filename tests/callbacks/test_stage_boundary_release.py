import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit.callbacks import StageBoundaryRelease
from lightning_memkit.demo import TinyMoE
from lightning_memkit.memory import stage_boundaries_enabled
from lightning_memkit.ops.padded_index_gather import padded_rows

B, T, D, K, M = 2, 16, 16, 2, 24


class Probe(TinyMoE):
    """Records whether marks are live in each hook."""

    def __init__(self, fail=False, **kw):
        super().__init__(d_model=D, n_layers=2, n_heads=2, seq_len=T, n_experts=4, top_k=K, d_expert=8,
                         pad_to_multiple=M, **kw)
        self.fail = fail
        self.seen = {"train": [], "val": []}

    def training_step(self, batch, batch_idx):
        self.seen["train"].append(stage_boundaries_enabled())
        if self.fail:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.seen["val"].append(stage_boundaries_enabled())
        return super().validation_step(batch, batch_idx)


def _loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (3 * B, T), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=B)


def _fit(model, cb, steps=3):
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=1, val_check_interval=2,
                      num_sanity_val_steps=0, callbacks=[cb], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, _loader(), _loader())
    return trainer


def test_releases_exact_bytes_in_training_steps_only():
    model, cb = Probe(exchange="copy"), StageBoundaryRelease()
    _fit(model, cb)
    rows = B * T * K
    per_layer = (padded_rows(rows, M) + rows) * D * 4  # dispatch input (padded) + expert outputs
    assert cb.released_bytes == 3 * 2 * per_layer
    assert cb.released == 3 * 2 * 2 and cb.kept == 0
    assert cb.last_stats.marks == 2 * 2  # two marks per MoE layer in the last step
    assert model.seen["train"] == [True] * 3 and model.seen["val"] == [False]
    assert not stage_boundaries_enabled()


def test_a_model_without_marks_is_reported_once(monkeypatch):
    import lightning_memkit.demo.moe as moe

    monkeypatch.setattr(moe, "stage_boundary", lambda t, *args, **kwargs: t)  # the model's marks removed
    model = Probe(exchange="copy")
    cb = StageBoundaryRelease()
    with pytest.warns(UserWarning, match=r"no stage_boundary\(\) mark ran during the training step") as caught:
        _fit(model, cb)
    assert sum("stage_boundary() mark" in str(w.message) for w in caught) == 1
    assert cb.released_bytes == 0 and cb.last_stats.marks == 0


def test_identity_exchange_keeps_and_counts():
    cb = StageBoundaryRelease()
    _fit(Probe(exchange="identity"), cb, steps=2)
    assert cb.released_bytes == 0 and cb.kept == 2 * 2 * 2
    assert "returned its input" in cb.last_stats.kept[0]


def test_disabled_is_a_noop_and_same_weights():
    weights = []
    for enabled in (True, False):
        torch.manual_seed(0)
        model, cb = Probe(exchange="copy"), StageBoundaryRelease(enabled=enabled)
        _fit(model, cb, steps=2)
        weights.append([p.detach().clone() for p in model.parameters()])
        assert model.seen["train"] == [enabled] * 2
    assert cb.released_bytes == 0
    assert all(torch.equal(a, b) for a, b in zip(*weights))


def test_block_closed_on_exception():
    model, cb = Probe(fail=True), StageBoundaryRelease()
    with pytest.raises(RuntimeError, match="boom"):
        _fit(model, cb)
    assert model.seen["train"] == [True] and not stage_boundaries_enabled()


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"enabled=\.\.\.\) must be a bool"):
        StageBoundaryRelease(enabled="yes")
    with pytest.raises(TypeError, match=r"check=\.\.\.\) must be a bool"):
        StageBoundaryRelease(check=None)
    with pytest.raises(TypeError, match=r"poison=\.\.\.\) must be None or a bool"):
        StageBoundaryRelease(poison=1)
