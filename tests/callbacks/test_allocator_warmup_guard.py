import logging
import sys
import types

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_memkit.callbacks import AllocatorWarmupGuard
from lightning_memkit.loading.allocator_warmup import ENV_VAR

_FAKE_SOURCE = """
calls = []

def caching_allocator_warmup(model, device_map, hf_quantizer):
    calls.append(device_map)
    return "ran"
"""


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    mod = types.ModuleType("memkit_fake_cb_loader")
    exec(_FAKE_SOURCE, mod.__dict__)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    mod.target = f"{mod.__name__}.caching_allocator_warmup"
    return mod


def _trainer(cb, **kw):
    return Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=1, callbacks=[cb], logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw)


class Probe(BoringModel):
    """Calls the warmup in setup and configure_model (guarded) and in on_fit_start (released)."""

    def __init__(self, fake, fail=False):
        super().__init__()
        self.fake, self.fail, self.results = fake, fail, {}

    def _call(self, where):
        self.results[where] = self.fake.caching_allocator_warmup(None, {where: "cpu"}, None)

    def setup(self, stage):
        self._call("setup")

    def configure_model(self):
        self._call("configure_model")

    def on_fit_start(self):
        self._call("on_fit_start")

    def training_step(self, batch, batch_idx):
        if self.fail:
            raise RuntimeError("step failed")
        return super().training_step(batch, batch_idx)


def test_active_through_configure_model_released_at_fit_start(fake, caplog):
    caplog.set_level(logging.INFO, logger="lightning_memkit")
    original = fake.caching_allocator_warmup
    cb = AllocatorWarmupGuard(mode="off", target=fake.target)
    model = Probe(fake)
    _trainer(cb).fit(model)
    assert model.results == {"setup": None, "configure_model": None, "on_fit_start": "ran"}
    assert [list(m) for m in fake.calls] == [["on_fit_start"]]  # the two guarded calls never reached it
    assert len(cb.calls) == 2 and all(c.skip for c in cb.calls)
    assert fake.caching_allocator_warmup is original and not cb.active
    assert caplog.text.count("AllocatorWarmupGuard: mode off") == 1


def test_mode_on_passes_through(fake):
    cb = AllocatorWarmupGuard(mode="on", target=fake.target)
    model = Probe(fake)
    _trainer(cb).fit(model)
    assert model.results["configure_model"] == "ran" and not cb.calls[-1].skip


def test_released_on_exception(fake):
    original = fake.caching_allocator_warmup
    cb = AllocatorWarmupGuard(mode="off", target=fake.target)
    with pytest.raises(RuntimeError, match="step failed"):
        _trainer(cb).fit(Probe(fake, fail=True))
    assert fake.caching_allocator_warmup is original and not cb.active


def test_validate_releases_at_validation_start(fake):
    original = fake.caching_allocator_warmup
    cb = AllocatorWarmupGuard(mode="off", target=fake.target)
    model = Probe(fake)
    _trainer(cb).validate(model, verbose=False)
    assert model.results["configure_model"] is None
    assert fake.caching_allocator_warmup is original


def test_invalid_arguments_fail_at_construction(monkeypatch):
    with pytest.raises(ValueError, match="mode='maybe' is not a warmup mode; allowed: on, off, auto, cap"):
        AllocatorWarmupGuard(mode="maybe")
    monkeypatch.setenv(ENV_VAR, "2")
    with pytest.raises(ValueError, match="MEMKIT_ALLOCATOR_WARMUP='2' is not a warmup mode"):
        AllocatorWarmupGuard()
    with pytest.raises(ValueError, match=r"guard_allocator_warmup\(threshold_bytes=-5\): must be an int >= 0"):
        AllocatorWarmupGuard(mode="auto", threshold_bytes=-5)


def test_from_pretrained_in_configure_model(tmp_path, monkeypatch):
    """A real ``from_pretrained(device_map="cpu")`` inside ``configure_model`` reaches the guarded warmup.

    With ``accelerate`` installed (the ``[hf]`` extra) nothing is forced. Without it, transformers refuses a
    ``device_map``; its availability check is then forced to True so the load path (and its call of
    ``caching_allocator_warmup``) runs as it would on a GPU machine.
    """
    transformers = pytest.importorskip("transformers")
    import transformers.integrations.accelerate as hf_accelerate
    import transformers.modeling_utils as mu

    if not hf_accelerate.is_accelerate_available():
        monkeypatch.setattr(hf_accelerate, "is_accelerate_available", lambda: True)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    original = mu.caching_allocator_warmup

    class HF(BoringModel):
        def configure_model(self):
            self.hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, device_map="cpu")

    cb = AllocatorWarmupGuard(mode="off")
    model = HF()
    _trainer(cb).fit(model)
    assert len(cb.calls) == 1 and cb.calls[0].skip
    assert torch.equal(model.hf.lm_head.weight, transformers.LlamaForCausalLM.from_pretrained(tmp_path).lm_head.weight)
    assert mu.caching_allocator_warmup is original


def test_yaml_configuration():
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(BoringModel, run=False, args={
        "trainer": {"logger": False, "callbacks": [{
            "class_path": "lightning_memkit.callbacks.AllocatorWarmupGuard",
            "init_args": {"mode": "cap", "margin_bytes": 1024},
        }]},
    })
    cb = next(c for c in cli.trainer.callbacks if isinstance(c, AllocatorWarmupGuard))
    assert cb._guard.mode == "cap" and cb._guard.margin_bytes == 1024
