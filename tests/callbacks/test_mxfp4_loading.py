import logging
import re

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from safetensors.torch import save_file
from torch import nn

from lightning_memkit.callbacks import MXFP4CheckpointLoader
from lightning_memkit.loading import dequantize_mxfp4

E, H, OUT = 2, 32, 8


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Parameter(torch.zeros(E, H, OUT))  # [E, in, out]
        self.bias = nn.Parameter(torch.zeros(E, OUT))


class Model(LightningModule):
    """Builds its model in configure_model and records the weights the run starts with."""

    def __init__(self):
        super().__init__()
        self.started_with = None

    def configure_model(self):
        if not hasattr(self, "net"):
            self.net = Experts()

    def on_fit_start(self):
        self.started_with = self.net.proj.detach().clone()

    def training_step(self, batch, batch_idx):
        return (self.net.proj.sum() + self.net.bias.sum()) * batch.sum()

    def validation_step(self, batch, batch_idx):
        pass

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(2, 1), batch_size=1)

    val_dataloader = train_dataloader

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture
def checkpoint(tmp_path):
    ckpt = {
        "proj_blocks": torch.randint(0, 256, (E, OUT, H // 32, 16), dtype=torch.uint8),
        "proj_scales": torch.randint(120, 134, (E, OUT, H // 32), dtype=torch.uint8),
        "bias": torch.randn(E, OUT),
    }
    path = tmp_path / "experts.safetensors"
    save_file(ckpt, path)
    return path, dequantize_mxfp4(ckpt["proj_blocks"], ckpt["proj_scales"], dtype=torch.float32), ckpt["bias"]


def _trainer(cb, max_steps=1):
    return Trainer(accelerator="cpu", devices=1, max_steps=max_steps, limit_val_batches=1, callbacks=[cb],
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def test_loads_before_the_first_step(checkpoint):
    path, proj, _ = checkpoint
    cb = MXFP4CheckpointLoader(str(path), submodule="net")
    model = Model()
    _trainer(cb).fit(model)
    assert torch.equal(model.started_with, proj)
    assert cb.result.dequantized == ["proj"] and cb.result.loaded == ["bias", "proj"]


def test_validate_loads_and_second_stage_does_not_reload(checkpoint):
    path, proj, bias = checkpoint
    cb = MXFP4CheckpointLoader(str(path), submodule="net")
    model = Model()
    trainer = _trainer(cb)
    trainer.validate(model, verbose=False)
    assert torch.equal(model.net.proj, proj) and torch.equal(model.net.bias, bias)
    with torch.no_grad():
        model.net.proj.add_(1.0)
    trainer.validate(model, verbose=False)  # loads once per callback: later stages keep trained weights
    assert torch.equal(model.net.proj, proj + 1.0)


def test_skipped_when_resuming(checkpoint, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lightning_memkit")
    path, proj, _ = checkpoint
    first = Model()
    trainer = _trainer(MXFP4CheckpointLoader(str(path), submodule="net"))
    trainer.fit(first)
    ckpt_path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt_path)
    cb = MXFP4CheckpointLoader(str(path), submodule="net")
    second = Model()
    _trainer(cb, max_steps=2).fit(second, ckpt_path=ckpt_path)
    assert cb.result is None and "not loaded" in caplog.text
    assert torch.equal(second.started_with, first.net.proj.detach())  # the resumed weights, not the file's


def test_bad_arguments(checkpoint, tmp_path):
    path, _, _ = checkpoint
    with pytest.raises(ValueError, match="path='.*missing.safetensors' does not exist"):
        MXFP4CheckpointLoader(str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match=r"MXFP4CheckpointLoader\(rows_per_chunk=-1\): must be an int >= 1 or None"):
        MXFP4CheckpointLoader(str(path), rows_per_chunk=-1)
    with pytest.raises(ValueError, match="submodule='nope' is not a submodule of Model"):
        _trainer(MXFP4CheckpointLoader(str(path), submodule="nope")).fit(Model())


def test_mismatch_fails_the_run_before_any_write(checkpoint):
    path, _, _ = checkpoint
    model = Model()
    with pytest.raises(ValueError, match="the module has no parameter or buffer 'bias'"):
        _trainer(MXFP4CheckpointLoader(str(path))).fit(model)  # names are relative to the submodule
    assert model.started_with is None


def test_yaml_configuration(checkpoint):
    from lightning.pytorch.cli import LightningCLI

    path, _, _ = checkpoint
    cli = LightningCLI(Model, run=False, args={
        "trainer": {"logger": False, "callbacks": [{
            "class_path": "lightning_memkit.callbacks.MXFP4CheckpointLoader",
            "init_args": {"path": str(path), "submodule": "net", "rows_per_chunk": 4},
        }]},
    })
    cb = next(c for c in cli.trainer.callbacks if isinstance(c, MXFP4CheckpointLoader))
    assert (cb.path, cb.submodule, cb.rows_per_chunk, cb.strict) == (str(path), "net", 4, True)


class MetaModel(Model):
    """Builds its experts on the meta device in ``__init__``: nothing to move until the callback loads it."""

    def __init__(self, with_buffer=False):
        super().__init__()
        with torch.device("meta"):
            self.net = Experts()
            if with_buffer:
                self.net.register_buffer("scale", torch.ones(OUT), persistent=False)


def test_meta_module_is_loaded_at_setup_on_the_root_device(checkpoint):
    path, proj, bias = checkpoint
    cb = MXFP4CheckpointLoader(str(path), submodule="net")
    model = MetaModel()
    _trainer(cb).fit(model)
    assert torch.equal(model.started_with, proj)
    assert sorted(cb.result.materialized) == ["bias", "proj"] and cb.result.memory is not None
    assert not any(t.is_meta for t in model.parameters())


def test_meta_module_is_loaded_when_resuming_and_the_checkpoint_wins(checkpoint, tmp_path):
    path, proj, _ = checkpoint
    first = Model()
    trainer = _trainer(MXFP4CheckpointLoader(str(path), submodule="net"))
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    cb = MXFP4CheckpointLoader(str(path), submodule="net")
    second = MetaModel()
    _trainer(cb, max_steps=2).fit(second, ckpt_path=tmp_path / "run.ckpt")
    assert cb.result is not None  # loaded, so that the Lightning checkpoint had real tensors to go into
    assert torch.equal(second.started_with, first.net.proj.detach())  # the resumed weights, not the file's


def test_meta_non_persistent_buffer_outside_transformers_is_named(checkpoint):
    path, _, _ = checkpoint
    model = MetaModel(with_buffer=True)
    with pytest.raises(Exception) as info:  # noqa: PT011 - Lightning's teardown may raise on top of it (below)
        _trainer(MXFP4CheckpointLoader(str(path), submodule="net")).fit(model)
    chain, err = [], info.value
    while err is not None:  # Lightning's teardown moves the module to the CPU, which a meta module refuses:
        chain.append(err)  # the loader's error is then the context of that one, still in the traceback
        err = err.__context__
    assert any(isinstance(e, ValueError) and re.search(r"scale: non-persistent buffer\(s\) on the meta device",
                                                        str(e)) for e in chain), chain
    assert model.net.proj.is_meta and model.started_with is None


def test_measure_switch(checkpoint):
    path, _, _ = checkpoint
    cb = MXFP4CheckpointLoader(str(path), submodule="net", measure=False)
    _trainer(cb).fit(Model())
    assert cb.result.memory is None and cb.result.dequantized == ["proj"]
    with pytest.raises(TypeError, match=r"MXFP4CheckpointLoader\(measure='yes'\): must be a bool, got str"):
        MXFP4CheckpointLoader(str(path), measure="yes")
