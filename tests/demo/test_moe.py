import pytest
import torch
import torch.nn.functional as F

from lightning_memkit.demo import TinyMoE
from lightning_memkit.demo.moe import MoEFeedForward, TokenExchange, _WeightedIndexAdd


def _dense_reference(layer, x):
    """Per-token loop in float64: sum over the chosen experts of weight * expert(x)."""
    x = x.double()
    w1, w2 = layer.experts.w1.double(), layer.experts.w2.double()
    probs = (x @ layer.router.weight.double().T).softmax(-1)
    top, chosen = probs.topk(layer.top_k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(layer.top_k):
            e = chosen[t, j]
            out[t] += top[t, j] * (F.gelu(x[t] @ w1[e]) @ w2[e])
    return out


@pytest.mark.parametrize("exchange", ["identity", "copy"])
def test_layer_matches_dense_fp64_reference(exchange):
    layer = MoEFeedForward(16, n_experts=4, top_k=2, d_expert=8, exchange=exchange, pad_to_multiple=16)
    x = torch.randn(2, 10, 16)
    y = layer(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y.double().view(-1, 16), _dense_reference(layer, x.view(-1, 16)), rtol=1e-5, atol=1e-6)
    assert torch.isfinite(layer.aux_loss) and layer.aux_loss > 0


def test_weighted_index_add_gradients():
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    w = torch.rand(7, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([0, 2, 2, 1, 0, 3, 2])
    assert torch.autograd.gradcheck(lambda a, b: _WeightedIndexAdd.apply(a, b, idx, 4), (x, w))


def test_keep_returns_stage_tensors():
    layer = MoEFeedForward(8, n_experts=2, top_k=1, exchange="copy", pad_to_multiple=4)
    keep = []
    layer(torch.randn(5, 8), keep=keep)
    permuted, expert_in, expert_out = keep
    assert permuted.shape == expert_in.shape == expert_out.shape == (5, 8)
    assert torch.equal(permuted, expert_in) and permuted.untyped_storage().nbytes() == 8 * 8 * 4


def test_model_forward_and_bad_arguments():
    model = TinyMoE(d_model=16, n_layers=1, n_heads=2, seq_len=8, n_experts=4, top_k=2, d_expert=8)
    assert model(torch.randint(0, 256, (2, 8))).shape == (2, 8, 256)
    with pytest.raises(ValueError, match="exceeds TinyMoE"):
        model(torch.randint(0, 256, (1, 9)))
    with pytest.raises(ValueError, match="top_k=5"):
        TinyMoE(n_experts=4, top_k=5)
    with pytest.raises(ValueError, match="exchange='nccl'"):
        TinyMoE(exchange="nccl")
    with pytest.raises(ValueError, match="n_heads=3"):
        TinyMoE(d_model=16, n_heads=3)
    with pytest.raises(ValueError, match="lr=0"):
        TinyMoE(lr=0)
    with pytest.raises(TypeError, match="d_expert"):
        TinyMoE(d_expert=8.0)
    with pytest.raises(ValueError, match="mode='x'"):
        TokenExchange("x")


def test_example_config_builds_model_data_and_callback(tmp_path):
    from pathlib import Path

    from lightning_memkit.callbacks import StageBoundaryRelease
    from lightning_memkit.config.lightning_cli import MemkitCLI

    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny_moe.yaml"
    cli = MemkitCLI(args=["--config", str(config), "--trainer.default_root_dir", str(tmp_path),
                          "--trainer.logger", "false"], run=False)
    assert isinstance(cli.model, TinyMoE) and cli.model.hparams.exchange == "copy"
    assert any(isinstance(cb, StageBoundaryRelease) and cb.enabled and cb.check for cb in cli.trainer.callbacks)
