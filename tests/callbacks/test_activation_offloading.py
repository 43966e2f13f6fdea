"""ActivationOffloading in a real Trainer fit: losses and weights bitwise equal alone and with ActivationCheckpointing
(either order), the bytes moved per step, restore at teardown and on an exception, peft models, errors."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch

from lightning_memkit.callbacks import ActivationCheckpointing, ActivationOffloading
from lightning_memkit.common.class_paths import instantiate
from lightning_memkit.demo import TinyLM
from lightning_memkit.demo.tiny_lm import Block
from lightning_memkit.offload import is_offloaded

SEQ, BATCH, D, LAYERS = 32, 4, 32, 3


class Windows(torch.utils.data.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        x = torch.randint(0, 256, (SEQ + 1,), generator=torch.Generator().manual_seed(i))
        return x[:-1], x[1:]


class Recorder(L.Callback):
    """The losses, and whether the blocks were offloaded while training."""

    def __init__(self):
        self.losses, self.offloaded = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())
        self.offloaded.append([is_offloaded(m) for _, m in _blocks(pl_module)])


def _blocks(module):
    from lightning_memkit.hf.layers import decoder_layers
    from lightning_memkit.recompute.activation_recompute import repeated_blocks

    return decoder_layers(module) or repeated_blocks(module)


def tiny_lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(d_model=D, n_layers=LAYERS, n_heads=2, seq_len=SEQ)


def fit(model, callbacks, data=None, steps=3):
    recorder = Recorder()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder, *callbacks])
    trainer.fit(model, data or torch.utils.data.DataLoader(Windows(), batch_size=BATCH))
    return recorder, model


def assert_same_run(a, b) -> None:
    (rec_a, model_a), (rec_b, model_b) = a, b
    assert len(rec_a.losses) == len(rec_b.losses) == 3
    assert all(torch.equal(x, y) for x, y in zip(rec_a.losses, rec_b.losses, strict=True))
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.fixture(scope="module")
def runs():
    """Fits shared by the tests: plain, checkpointed, and with the callback in each combination."""
    out = {"plain": fit(tiny_lm(), []), "checkpointed": fit(tiny_lm(), [ActivationCheckpointing()])}
    alone = ActivationOffloading()
    out["offloaded"] = fit(tiny_lm(), [alone]) + (alone,)
    for name, make in (("checkpoint, offload", lambda cb: [ActivationCheckpointing(), cb]),
                       ("offload, checkpoint", lambda cb: [cb, ActivationCheckpointing()])):
        cb = ActivationOffloading()
        out[name] = fit(tiny_lm(), make(cb)) + (cb,)
    return out


def test_losses_and_weights_bitwise_equal_alone(runs):
    recorder, model, callback = runs["offloaded"]
    assert_same_run((recorder, model), runs["plain"])
    assert recorder.offloaded == [[True] * LAYERS] * 3  # hooked during training
    assert not any(is_offloaded(m) for _, m in _blocks(model))  # unhooked at teardown
    assert callback.offloaded == [f"blocks.{i}" for i in range(LAYERS)]
    assert callback.step_bytes > LAYERS * BATCH * SEQ * D * 4 and callback.host_peak_bytes == callback.step_bytes


@pytest.mark.parametrize("order", ["checkpoint, offload", "offload, checkpoint"])
def test_losses_and_weights_bitwise_equal_with_checkpointing_in_either_order(runs, order):
    recorder, model, callback = runs[order]
    assert_same_run((recorder, model), runs["checkpointed"])
    assert recorder.offloaded == [[True] * LAYERS] * 3
    # a checkpointed block keeps its input only: one (batch, seq, d) float32 tensor per block, every step
    assert (callback.step_bytes, callback.step_tensors) == (LAYERS * BATCH * SEQ * D * 4, LAYERS)
    assert callback.host_peak_bytes == callback.step_bytes
    assert callback.memory_effect() == (
        f"ActivationOffloading: 3 blocks (blocks.0, blocks.1, blocks.2); {LAYERS * BATCH * SEQ * D * 4:,} bytes "
        "(48.00 KiB) in 3 tensors moved to host memory in the last batch; host peak 49,152 bytes")


def test_restored_on_an_exception():
    class Failing(TinyLM):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    model = Failing(d_model=D, n_layers=LAYERS, n_heads=2, seq_len=SEQ)
    callback = ActivationOffloading(policy={Block}, min_bytes=0, prefetch=False)
    with pytest.raises(RuntimeError, match="boom"):
        fit(model, [callback])
    assert not any(is_offloaded(b) or b._forward_hooks or b._forward_pre_hooks for b in model.blocks)
    assert callback.step_bytes > 0  # the first batch ran offloaded


def test_peft_wrapped_transformers_model_trains_the_same():
    pytest.importorskip("peft")
    from lightning_memkit.demo import HFCausalLM

    def module():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return HFCausalLM(family="llama", num_layers=2, seed=0, config_overrides={"use_cache": False},
                              peft_lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})

    ids = torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(1))
    data = lambda: torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=2)
    callback = ActivationOffloading()
    plain = fit(module(), [], data())
    offloaded = fit(module(), [callback], data())
    assert_same_run(offloaded, plain)
    assert callback.offloaded == ["model.base_model.model.model.layers.0", "model.base_model.model.model.layers.1"]
    assert offloaded[0].offloaded == [[True, True]] * 3 and callback.step_bytes > 0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"ActivationOffloading\(min_bytes=-1\): must be an int >= 0"):
        ActivationOffloading(min_bytes=-1)
    with pytest.raises(TypeError, match=r"ActivationOffloading\(min_bytes='1k'\): must be an int >= 0, got str"):
        ActivationOffloading(min_bytes="1k")
    with pytest.raises(TypeError, match=r"ActivationOffloading\(prefetch='yes'\): must be a bool, got str"):
        ActivationOffloading(prefetch="yes")
    with pytest.raises(ValueError, match="'lightning_memkit.demo.tiny_lm.NoBlock' cannot be imported"):
        ActivationOffloading(policy=["lightning_memkit.demo.tiny_lm.NoBlock"])


def test_auto_without_blocks_and_self_recomputing_layers_are_refused():
    class Flat(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

    callback = ActivationOffloading()
    with pytest.raises(ValueError, match=r"ActivationOffloading\(policy='auto'\) found in Flat neither Hugging Face "
                                         r"decoder layers .* module classes to offload"):
        callback.on_fit_start(None, Flat())
    model = tiny_lm()
    for block in model.blocks:
        block.gradient_checkpointing = True  # as Hugging Face's gradient_checkpointing_enable() marks its layers
    with pytest.raises(ValueError, match=r"3 chosen layers \(blocks.0, blocks.1, blocks.2\) already recompute "
                                         r"themselves .* or remove ActivationOffloading"):
        callback.on_fit_start(None, model)
    assert not any(is_offloaded(b) for b in model.blocks)


def test_configured_by_class_path_with_plain_init_args():
    callback = instantiate({"class_path": "lightning_memkit.callbacks.ActivationOffloading",
                            "init_args": {"policy": ["lightning_memkit.demo.tiny_lm.Block"], "min_bytes": 4096,
                                          "prefetch": False}})
    assert (callback.policy, callback.min_bytes, callback.prefetch) == (["lightning_memkit.demo.tiny_lm.Block"], 4096,
                                                                        False)
    assert callback.memory_effect() == "ActivationOffloading: no block offloaded"
