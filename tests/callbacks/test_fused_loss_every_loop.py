"""FusedLinearCrossEntropy in every loop: fit (with its validation), validate, test and predict (Liger-Kernel#703)."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import lightning as L  # noqa: E402

from lightning_memkit.callbacks import FusedLinearCrossEntropy  # noqa: E402
from lightning_memkit.demo.hf_models import tiny_hf_causal_lm  # noqa: E402
from lightning_memkit.measure.allocator_peak import AllocatorPeak  # noqa: E402
from lightning_memkit.memory import LivePeak  # noqa: E402

VOCAB, B, T = 128, 2, 16


def trainer(callbacks, **kwargs):
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=callbacks, **kwargs)


def token_data(vocab=VOCAB, b=B, t=T, batches=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b * batches, t), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=b)


class LMModule(L.LightningModule):
    """Holds a HF causal LM; every step calls it (with labels unless ``labels=False``) and records what it saw."""

    def __init__(self, lm, labels=True, fail_in=None, measure=False):
        super().__init__()
        self.lm = lm
        self.labels, self.fail_in, self.measure = labels, fail_in, measure
        self.seen = []  # (stage, logits, loss)
        self.peaks = []  # (stage, LivePeak peak, largest LivePeak allocation, AllocatorPeak peak) when measure=True

    def _call(self, stage, ids):
        if self.fail_in == stage:
            raise RuntimeError(f"boom in {stage}")
        kwargs = dict(input_ids=ids, labels=ids) if self.labels else dict(input_ids=ids)
        if self.measure:
            allocations = []
            last = {}

            def on_change(device, live):  # consecutive live counts: each change is one allocation or free
                allocations.append(live - last.get(device, 0))
                last[device] = live

            with AllocatorPeak("cpu") as allocated, LivePeak() as peak:
                peak.on_change = on_change
                out = self.lm(**kwargs)
            self.peaks.append((stage, peak.peak_bytes, max(allocations, default=0), allocated.peak_bytes))
        else:
            out = self.lm(**kwargs)
        self.seen.append((stage, out.logits, None if out.loss is None else out.loss.detach()))
        return out

    def training_step(self, batch, batch_idx):
        return self._call("train", batch[0]).loss

    def validation_step(self, batch, batch_idx):
        self._call("validate" if not self.trainer.sanity_checking else "sanity", batch[0])

    def test_step(self, batch, batch_idx):
        self._call("test", batch[0])

    def predict_step(self, batch, batch_idx):
        return self._call("predict", batch[0]).logits

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(fn, lm, callbacks, **module_kwargs):
    module = LMModule(copy.deepcopy(lm), **module_kwargs)
    getattr(trainer(callbacks), fn)(module, token_data())
    return module


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("fn", ["validate", "test", "predict"])
def test_standalone_loops_are_fused_with_the_same_loss(family, fn):
    lm = tiny_hf_causal_lm(family, seed=0, vocab_size=VOCAB)
    callback = FusedLinearCrossEntropy()
    fused = run(fn, lm, [callback])
    plain = run(fn, lm, [])
    assert len(fused.seen) == len(plain.seen) == 2
    assert all(logits is None for _, logits, _ in fused.seen)
    assert all(logits.shape == (B, T, VOCAB) for _, logits, _ in plain.seen)
    for (_, _, loss), (_, _, ref) in zip(fused.seen, plain.seen):
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=0)
    assert callback.fused_calls == 2 and callback.max_logits_bytes == B * T * VOCAB * 4
    assert "forward" not in vars(fused.lm)  # left at the loop's end


def test_predict_without_labels_returns_logits():
    lm = tiny_hf_causal_lm("llama", seed=0, vocab_size=VOCAB)
    callback = FusedLinearCrossEntropy()
    module = LMModule(copy.deepcopy(lm), labels=False)
    predictions = trainer([callback]).predict(module, token_data())
    assert [p.shape for p in predictions] == [(B, T, VOCAB)] * 2
    assert callback.fused_calls == 0
    line = callback.memory_effect()
    assert line == "FusedLinearCrossEntropy: no forward call with labels ran fused during this predict"
    assert "forward" not in vars(module.lm)


def test_fit_with_validation_stays_fused_throughout():
    lm = tiny_hf_causal_lm("llama", seed=0, vocab_size=VOCAB)
    callback = FusedLinearCrossEntropy()
    patched = []  # whether the forward is patched at each step

    class Module(LMModule):
        def _call(self, stage, ids):
            patched.append((stage, "forward" in vars(self.lm)))
            return super()._call(stage, ids)

    module = Module(copy.deepcopy(lm))
    trainer([callback], max_steps=4, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=1).fit(
        module, token_data(batches=4), token_data(seed=1))
    stages = [s for s, _, _ in module.seen]
    # sanity check, then training interleaved with fit's validation: training runs fused after validation too
    assert stages == ["sanity", "train", "train", "validate", "train", "train", "validate"]
    assert all(p for _, p in patched)
    assert all(logits is None and loss is not None for _, logits, loss in module.seen)
    assert callback.fused_calls == len(stages)
    assert "forward" not in vars(module.lm)


@pytest.mark.parametrize("fn", ["fit", "validate", "test", "predict"])
def test_forward_restored_when_a_step_raises(fn):
    lm = tiny_hf_causal_lm("llama", seed=0, vocab_size=VOCAB)
    stage = {"fit": "train"}.get(fn, fn)
    module = LMModule(copy.deepcopy(lm), fail_in=stage)
    with pytest.raises(RuntimeError, match=f"boom in {stage}"):
        getattr(trainer([FusedLinearCrossEntropy()], max_steps=1, num_sanity_val_steps=0), fn)(module, token_data())
    assert "forward" not in vars(module.lm)
    ids = torch.randint(0, VOCAB, (B, T))
    assert module.lm(input_ids=ids, labels=ids).logits.shape == (B, T, VOCAB)  # the plain forward again


def test_one_callback_through_fit_validate_test_predict():
    lm = tiny_hf_causal_lm("llama", seed=0, vocab_size=VOCAB)
    callback = FusedLinearCrossEntropy()
    module = LMModule(copy.deepcopy(lm))
    t = trainer([callback], max_steps=2, limit_val_batches=1, num_sanity_val_steps=1)
    t.fit(module, token_data(), token_data(seed=1))
    assert "forward" not in vars(module.lm) and callback.fused_calls == 4  # sanity + 2 train + 1 end-of-epoch val
    for fn in ("validate", "test", "predict"):
        module.seen.clear()
        getattr(t, fn)(module, token_data())
        calls = 1 if fn == "validate" else 2  # limit_val_batches=1 holds for trainer.validate too
        assert [logits for _, logits, _ in module.seen] == [None] * calls, fn
        assert callback.fused_calls == calls, fn  # the counters restart with each top-level loop
        assert "forward" not in vars(module.lm), fn


def test_memory_effect_names_the_validate_run():
    lm = tiny_hf_causal_lm("llama", seed=0, vocab_size=VOCAB)
    callback = FusedLinearCrossEntropy()
    run("validate", lm, [callback])
    per_call = B * T * VOCAB * 4
    assert (callback.fused_calls, callback.max_logits_bytes, callback.logits_bytes_avoided) == (2, per_call,
                                                                                              2 * per_call)
    line = callback.memory_effect()
    assert line.startswith("FusedLinearCrossEntropy: logits not materialized in 2 forward calls during validate")
    assert f"{per_call:,} bytes per call at most ({2 * per_call:,} bytes in all" in line


@pytest.mark.parametrize("inference_mode", [True, False])
@pytest.mark.parametrize("fn", ["validate", "test", "predict"])
def test_step_peak_lower_by_the_logits_and_no_logits_allocated(fn, inference_mode):
    vocab, b, t = 4096, 2, 64
    lm = tiny_hf_causal_lm("llama", seed=0, vocab_size=vocab)
    logits_bytes = b * t * vocab * 4  # fp32 (B, T, V) logits: 2 MiB

    def peaks(callbacks):
        module = LMModule(copy.deepcopy(lm), measure=True)
        getattr(trainer(callbacks, inference_mode=inference_mode), fn)(module, token_data(vocab, b, t, batches=1))
        assert [s for s, *_ in module.peaks] == [fn]
        return module.peaks[0][1:]

    plain_peak, plain_largest, plain_allocated = peaks([])
    fused_peak, fused_largest, fused_allocated = peaks([FusedLinearCrossEntropy(chunk_size=32)])  # 4 chunks
    print(f"\n{fn} inference_mode={inference_mode}: LivePeak step peak without the callback {plain_peak:,} B, with "
          f"{fused_peak:,} B; largest allocation {plain_largest:,} B vs {fused_largest:,} B; AllocatorPeak "
          f"{plain_allocated:,} B vs {fused_allocated:,} B (logits {logits_bytes:,} B)")
    assert plain_largest >= logits_bytes  # without the callback HF allocates the (B, T, V) logits
    assert fused_largest < logits_bytes  # with it, no allocation is as large as the logits
    # the allocator's count (every CPU allocation) drops by at least the logits' bytes
    assert plain_allocated - fused_allocated >= logits_bytes, (plain_allocated, fused_allocated)
    # LivePeak sees the logits and HF's log-softmax of them, under inference mode too (composite ops decomposed)
    assert plain_peak - fused_peak >= logits_bytes, (plain_peak, fused_peak)
    assert plain_peak == plain_allocated and fused_peak == fused_allocated  # every CPU allocation is a tensor here
