"""Resuming a ``NoSaveBitsandbytesPrecision`` run: the model is converted before the checkpoint is restored
(``QuantizedResume``, on every Trainer through Lightning's entry point), each packed weight comes back bit for bit,
and the resumed run has the losses of the run that never stopped (after a SIGKILL: tests/callbacks/
test_resume_features.py)."""

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from lightning_memkit.plugins import NoSaveBitsandbytesPrecision
from lightning_memkit.plugins.nosave_bitsandbytes import packed_modes
from lightning_memkit.plugins.quantized_resume import QuantizedResume

pytest.importorskip("bitsandbytes")

MODES = ["nf4", "nf4-dq", "fp4", "fp4-dq", "int8"]


def _dtype(mode):
    return "float16" if mode == "int8" else "bfloat16"


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32, bias=False))


@pytest.mark.parametrize("mode", MODES)
def test_a_converted_state_dict_loads_bit_for_bit_into_a_fresh_model(mode):
    plugin = NoSaveBitsandbytesPrecision(mode, _dtype(mode), lora_rank=2)
    trained = plugin.convert_module(_net())
    with torch.no_grad():
        for p in trained.parameters():
            if p.requires_grad:
                p.add_(0.01)  # adapters away from their initial values
    saved = trained.state_dict()
    assert packed_modes(saved) == {mode}
    fresh = _net()
    with torch.no_grad():
        fresh[0].weight.mul_(3)  # other base weights: the saved packed ones must win
    handle = NoSaveBitsandbytesPrecision(mode, _dtype(mode), lora_rank=2).convert_on_load(fresh)
    fresh.load_state_dict(saved)  # strict
    handle.remove()
    loaded = fresh.state_dict()
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
    x = torch.randn(5, 64, dtype=getattr(torch, _dtype(mode)))
    assert torch.equal(fresh(x), trained(x))


def test_a_state_dict_of_another_mode_is_refused_before_the_model_changes():
    saved = NoSaveBitsandbytesPrecision("nf4", "bfloat16", lora_rank=2).convert_module(_net()).state_dict()
    fresh = _net()
    NoSaveBitsandbytesPrecision("fp4", "bfloat16", lora_rank=2).convert_on_load(fresh)
    with pytest.raises(ValueError, match=r"mode='fp4'\) cannot load a state dict quantized as nf4"):
        fresh.load_state_dict(saved)
    assert type(fresh[0]) is nn.Linear  # not converted


def test_a_packed_weight_of_another_shape_is_refused():
    saved = NoSaveBitsandbytesPrecision("nf4", "bfloat16").convert_module(nn.Sequential(nn.Linear(64, 64)))
    target = NoSaveBitsandbytesPrecision("nf4", "bfloat16").convert_module(nn.Sequential(nn.Linear(64, 32)))
    with pytest.raises(ValueError, match="is not this layer's layout"):
        target.load_state_dict(saved.state_dict())


def test_every_trainer_has_the_callback_and_it_is_inert_without_the_plugin(tmp_path):
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=1,
                      enable_progress_bar=False, enable_model_summary=False)
    hooks = [cb for cb in trainer.callbacks if isinstance(cb, QuantizedResume)]
    assert len(hooks) == 1
    from lightning.pytorch.demos.boring_classes import BoringModel

    model = BoringModel()
    trainer.fit(model)
    assert hooks[0]._handle is None and not model._load_state_dict_pre_hooks


class _Losses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _fit(max_steps, mode, rank, peft, dirpath, ckpt_path=None, family="llama"):
    from lightning_memkit.demo import ByteTextDataModule, HFCausalLM

    torch.manual_seed(0)
    model = HFCausalLM(family, peft_lora={"r": 4, "target_modules": ["q_proj", "v_proj"]} if peft else None)
    data = ByteTextDataModule(batch_size=4, seq_len=32, batch_format="hf", max_bytes=20_000, samples_per_epoch=8)
    losses = _Losses()
    trainer = Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0,
                      plugins=[NoSaveBitsandbytesPrecision(mode, _dtype(mode), lora_rank=rank)],
                      callbacks=[losses, ModelCheckpoint(dirpath=dirpath, save_last=True, every_n_train_steps=1)])
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return losses.losses, model


@pytest.mark.parametrize(("mode", "rank", "peft", "family"), [
    ("nf4", 4, False, "llama"), ("nf4-dq", 0, True, "llama"), ("fp4", 4, False, "llama"),
    ("int8", 4, False, "llama"), ("nf4", 4, False, "qwen3_moe"),
], ids=["nf4-own-adapters", "nf4-dq-peft", "fp4-own-adapters", "int8-own-adapters", "nf4-qwen3-moe"])
def test_a_resumed_qlora_fit_has_the_losses_of_the_fit_that_never_stopped(tmp_path, mode, rank, peft, family):
    """Two steps per epoch: the checkpoint after step 2 ends an epoch, so the data of steps 3-4 are the same."""
    straight, done = _fit(4, mode, rank, peft, tmp_path / "straight", family=family)
    first, _ = _fit(2, mode, rank, peft, tmp_path / "resumed", family=family)
    rest, resumed = _fit(4, mode, rank, peft, tmp_path / "resumed", ckpt_path="last", family=family)
    assert first + rest == straight  # bitwise on CPU
    trained = {k: v for k, v in done.state_dict().items()}
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, trained[key]), key


def test_validate_from_a_qlora_checkpoint_loads_it_as_trained(tmp_path):
    """``trainer.validate(model, ckpt_path=...)`` (and test, predict) converts before restoring too."""
    from lightning_memkit.demo import ByteTextDataModule, HFCausalLM

    _, trained = _fit(2, "nf4", 4, False, tmp_path / "ckpt")
    data = ByteTextDataModule(batch_size=4, seq_len=32, batch_format="hf", max_bytes=20_000, samples_per_epoch=8)
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=2, plugins=[NoSaveBitsandbytesPrecision("nf4", "bfloat16", lora_rank=4)])
    fresh = HFCausalLM("llama")
    trainer.validate(fresh, data, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"), verbose=False)
    reference = trained.state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in fresh.state_dict().items())


def test_a_packed_weight_without_its_quant_state_is_refused():
    """A malformed converted state dict (one layer's absmax and quant map lost) is an error, not a guess."""
    plugin = NoSaveBitsandbytesPrecision("nf4", "bfloat16", lora_rank=2)
    saved = plugin.convert_module(_net()).state_dict()
    broken = {k: v for k, v in saved.items() if not k.startswith("2.weight.")}
    target = NoSaveBitsandbytesPrecision("nf4", "bfloat16", lora_rank=2).convert_module(_net())
    with pytest.raises(ValueError, match=r"packed weight 2.weight but no quant state \(absmax, quant_map\)"):
        target.load_state_dict(broken)
