"""fused_linear_cross_entropy on tiny random HF causal LMs: same loss and gradients as HF, no logits."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_memkit.hf import fused_linear_cross_entropy  # noqa: E402
from lightning_memkit.memory import LivePeak  # noqa: E402

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=128)


def make_model(name: str, vocab_size: int = 128, router_aux: bool = True):
    cfg = {**COMMON, "vocab_size": vocab_size}
    if name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    elif name == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**cfg, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             output_router_logits=router_aux)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.GptOssConfig(**cfg, num_local_experts=4, num_experts_per_tok=2,
                                           output_router_logits=router_aux)
        model = transformers.GptOssForCausalLM(config)
    return model.float()


def batch(vocab_size: int = 128, b: int = 2, t: int = 16):
    ids = torch.randint(0, vocab_size, (b, t))
    labels = ids.clone()
    labels[0, :5] = -100
    labels[1, -3:] = -100
    return ids, labels


def loss_and_grads(model, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("num_items", [None, 17])
def test_matches_hf_loss_and_grads(name, num_items):
    model = make_model(name)
    ids, labels = batch()
    kwargs = dict(input_ids=ids, labels=labels)
    if num_items is not None:
        kwargs["num_items_in_batch"] = torch.tensor(num_items)
    ref, ref_grads = loss_and_grads(model, **kwargs)
    with fused_linear_cross_entropy(model):
        out, grads = loss_and_grads(model, **kwargs)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=0)
    if name != "llama":
        torch.testing.assert_close(out.aux_loss, ref.aux_loss, atol=1e-6, rtol=0)
    assert grads.keys() == ref_grads.keys() and len(grads) == sum(1 for _ in model.parameters())
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], atol=1e-5, rtol=1e-4, msg=n)


def test_moe_without_router_aux_and_positional_labels():
    model = make_model("qwen3_moe", router_aux=False)
    ids, labels = batch()
    ref = model(ids, None, None, None, None, labels)
    with fused_linear_cross_entropy(model):
        out = model(ids, None, None, None, None, labels)
    assert out.aux_loss is None and out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=0)


def test_without_labels_falls_back_and_logits_to_keep():
    model = make_model("llama")
    ids, labels = batch()
    with fused_linear_cross_entropy(model):
        plain = model(input_ids=ids)
        kept = model(input_ids=ids, labels=labels[:, -4:], logits_to_keep=4)
    ref = model(input_ids=ids, labels=labels[:, -4:], logits_to_keep=4)
    assert plain.logits.shape == (2, 16, 128)
    assert kept.logits is None
    torch.testing.assert_close(kept.loss, ref.loss, atol=1e-5, rtol=0)


def test_forward_restored_even_on_error():
    model = make_model("llama")
    assert "forward" not in model.__dict__
    with pytest.raises(RuntimeError, match="boom"):
        with fused_linear_cross_entropy(model):
            assert "forward" in model.__dict__
            raise RuntimeError("boom")
    assert "forward" not in model.__dict__
    ids, labels = batch()
    assert model(input_ids=ids, labels=labels).logits.shape == (2, 16, 128)  # the plain forward again: logits


def test_refuses_bad_arguments():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        with fused_linear_cross_entropy(torch.nn.Linear(2, 2)):
            pass
    model = make_model("llama")
    with pytest.raises(ValueError, match="chunk_size"):
        with fused_linear_cross_entropy(model, chunk_size=0):
            pass
    assert "forward" not in model.__dict__


def test_peak_lower_than_hf_by_logits_bytes():
    vocab, b, t = 4096, 2, 64
    model = make_model("llama", vocab_size=vocab)
    ids, labels = batch(vocab, b, t)

    def step():
        model.zero_grad(set_to_none=True)
        with LivePeak() as peak:
            model(input_ids=ids, labels=labels).loss.backward()
        return peak.peak_bytes

    step()
    hf_peak = step()
    with fused_linear_cross_entropy(model):
        fused_peak = step()
    assert hf_peak - fused_peak >= b * t * vocab * 4, (hf_peak, fused_peak)


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "gpt_oss"])
def test_callback_in_trainer(name):
    import lightning as L

    from lightning_memkit.callbacks import FusedLinearCrossEntropy

    class Module(L.LightningModule):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm
            self.losses, self.logits = [], []

        def training_step(self, batch, batch_idx):
            out = self.lm(input_ids=batch[0], labels=batch[1])
            self.losses.append(out.loss.item())
            self.logits.append(out.logits)
            return out.loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    ids, labels = batch()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, labels), batch_size=2)
    lm = make_model(name)

    def fit(callbacks):
        module = Module(copy.deepcopy(lm))
        trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
        trainer.fit(module, data)
        return module

    fused = fit([FusedLinearCrossEntropy()])
    plain = fit([])
    assert "forward" not in fused.lm.__dict__
    assert all(x is None for x in fused.logits) and plain.logits[0] is not None
    assert fused.losses[0] == pytest.approx(plain.losses[0], abs=1e-5)
    assert fused.losses[-1] < fused.losses[0]
    assert fused.losses == pytest.approx(plain.losses, abs=1e-4)


def test_callback_refuses_module_without_hf_model():
    import lightning as L

    from lightning_memkit.callbacks import FusedLinearCrossEntropy

    with pytest.raises(ValueError, match="lm_head"):
        FusedLinearCrossEntropy().on_fit_start(None, L.LightningModule())
    with pytest.raises(ValueError, match="chunk_size"):
        FusedLinearCrossEntropy(chunk_size=-1)


def test_final_logit_softcapping_is_applied():
    config = transformers.Gemma2Config(**COMMON, final_logit_softcapping=30.0)
    model = transformers.Gemma2ForCausalLM(config).float()
    ids, labels = batch()
    ref, ref_grads = loss_and_grads(model, input_ids=ids, labels=labels)
    with fused_linear_cross_entropy(model):
        out, grads = loss_and_grads(model, input_ids=ids, labels=labels)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], atol=1e-5, rtol=1e-4, msg=n)
