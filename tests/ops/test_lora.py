import math

import pytest
import torch

from lightning_memkit.memory import LivePeak
from lightning_memkit.ops.lora import LoRAAdapter, check_lora_args


def test_init_scaling_and_reference():
    lora = LoRAAdapter(32, 24, rank=4, alpha=8)
    assert lora.A.shape == (4, 32) and lora.B.shape == (24, 4) and lora.A.dtype == torch.float32
    assert torch.count_nonzero(lora.B) == 0 and lora.scaling == 2.0
    assert lora.A.abs().max() <= 1 / math.sqrt(32)  # kaiming_uniform(a=sqrt(5)) bound: 1/sqrt(fan_in)
    torch.nn.init.normal_(lora.B)
    x = torch.randn(5, 32, dtype=torch.float64)
    expected = x @ lora.A.double().t() @ lora.B.double().t() * 2.0
    torch.testing.assert_close(lora(x.float()).double(), expected, rtol=1e-5, atol=1e-5)


def test_computes_in_the_input_dtype_and_trains_float32_params():
    lora = LoRAAdapter(16, 8, rank=2)
    torch.nn.init.normal_(lora.B)
    x = torch.randn(3, 16, dtype=torch.bfloat16, requires_grad=True)
    out = lora(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert lora.A.grad.dtype == lora.B.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def test_dropout_only_in_training():
    lora = LoRAAdapter(16, 8, rank=2, dropout=0.5)
    torch.nn.init.normal_(lora.B)
    x = torch.randn(64, 16)
    lora.eval()
    torch.testing.assert_close(lora(x), lora(x))
    lora.train()
    assert not torch.equal(lora(x), lora(x))


def test_retains_its_input_and_the_rank_intermediate_only():
    lora = LoRAAdapter(64, 32, rank=4)
    base = torch.randn(10, 64, requires_grad=True)
    with LivePeak() as lp:
        x = base * 1.0
        out = lora(x)
        del x
        retained = lp.live_bytes - out.untyped_storage().nbytes()
    assert retained == 10 * 64 * 4 + 10 * 4 * 4


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [((-1, 16, 0.0), ValueError, r"LoRAAdapter\(lora_rank=-1\): must be an int >= 0"),
     ((True, 16, 0.0), TypeError, r"LoRAAdapter\(lora_rank=True\): must be an int >= 0, got bool"),
     ((4, float("inf"), 0.0), ValueError, r"LoRAAdapter\(lora_alpha=inf\): must be a finite number > 0"),
     ((4, 16, -0.1), ValueError, r"LoRAAdapter\(lora_dropout=-0.1\): must be a finite number >= 0 and < 1")],
)
def test_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        check_lora_args(*args)
    with pytest.raises(ValueError, match=r"LoRAAdapter\(lora_rank=0\): must be an int >= 1"):
        LoRAAdapter(4, 4, rank=0)


# -- ExpertLoRAAdapter -----------------------------------------------------------------------------------
def test_expert_adapter_shapes_init_and_reference():
    from lightning_memkit.ops.lora import ExpertLoRAAdapter

    lora = ExpertLoRAAdapter(3, 32, 24, rank=4, alpha=8)
    assert lora.A.shape == (3, 32, 4) and lora.B.shape == (3, 4, 24) and lora.A.dtype == torch.float32
    assert torch.count_nonzero(lora.B) == 0 and lora.scaling == 2.0
    assert lora.A.abs().max() <= 1 / math.sqrt(32) and lora.A.std() > 0.25 / math.sqrt(32)
    assert lora(torch.randn(5, 32), 1).abs().max() == 0
    torch.nn.init.normal_(lora.B)
    x = torch.randn(5, 32, requires_grad=True)
    out = lora(x, 2)
    out.backward(torch.ones_like(out))
    x64 = x.detach().double().requires_grad_()
    a64 = lora.A.detach().double().requires_grad_()
    b64 = lora.B.detach().double().requires_grad_()
    ref = x64 @ a64[2] @ b64[2] * 2.0
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for got, expected in ((x.grad, x64.grad), (lora.A.grad, a64.grad), (lora.B.grad, b64.grad)):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert lora.A.grad[[0, 1]].abs().max() == 0 and lora.B.grad[[0, 1]].abs().max() == 0  # only expert 2


def test_expert_adapter_computes_in_the_input_dtype():
    from lightning_memkit.ops.lora import ExpertLoRAAdapter

    lora = ExpertLoRAAdapter(2, 16, 8, rank=2)
    torch.nn.init.normal_(lora.B)
    x = torch.randn(3, 16, dtype=torch.bfloat16, requires_grad=True)
    out = lora(x, 0)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert lora.A.grad.dtype == lora.B.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"rank": 0}, ValueError, r"ExpertLoRAAdapter\(lora_rank=0\): must be an int >= 1"),
     ({"num_experts": 0}, ValueError, r"ExpertLoRAAdapter\(num_experts=0\): must be an int >= 1"),
     ({"in_features": 2.0}, TypeError, r"ExpertLoRAAdapter\(in_features=2.0\): must be an int >= 1, got float"),
     ({"dropout": 1.0}, ValueError, r"ExpertLoRAAdapter\(lora_dropout=1.0\): must be a finite number >= 0 and < 1")],
)
def test_expert_adapter_bad_arguments(kwargs, error, match):
    from lightning_memkit.ops.lora import ExpertLoRAAdapter

    args = {"num_experts": 2, "in_features": 4, "out_features": 4, "rank": 2, **kwargs}
    with pytest.raises(error, match=match):
        ExpertLoRAAdapter(**args)


# -- freeze_base_ ----------------------------------------------------------------------------------------
def test_freeze_base_freezes_and_casts_everything_but_adapters():
    from lightning_memkit.ops.lora import ExpertLoRAAdapter, freeze_base_

    net = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 8), "proj": torch.nn.Linear(8, 8),
                               "head": torch.nn.Linear(8, 10, bias=False)})
    net.proj.lora = LoRAAdapter(8, 8, rank=2)
    net.experts_lora = ExpertLoRAAdapter(2, 8, 8, rank=2)
    net.head.weight = net.emb.weight  # tied: one parameter
    net.codes = torch.nn.Parameter(torch.zeros(3, dtype=torch.uint8), requires_grad=False)
    weight = net.proj.weight
    assert freeze_base_(net, torch.float16) == ["codes", "emb.weight", "proj.weight", "proj.bias"]
    assert net.proj.weight is weight and weight.dtype == torch.float16 and not weight.requires_grad
    assert net.head.weight is net.emb.weight and net.emb.weight.dtype == torch.float16
    assert net.codes.dtype == torch.uint8
    adapters = [p for n, p in net.named_parameters() if "lora" in n]
    assert len(adapters) == 4 and all(p.requires_grad and p.dtype == torch.float32 for p in adapters)


def _peft_update(x, lora):
    """peft's adapter on a 16-bit base: the input widened to float32, the update formed there, rounded once."""
    linear = torch.nn.functional.linear
    return (linear(linear(x.float(), lora.A), lora.B) * lora.scaling).to(x.dtype)


def test_the_update_has_peft_numerics_and_gradients():
    lora = LoRAAdapter(64, 48, rank=4, alpha=8)
    torch.nn.init.normal_(lora.B)
    x = torch.randn(2, 7, 64, dtype=torch.bfloat16, requires_grad=True)
    out = lora(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, _peft_update(x, lora))
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (x, lora.A, lora.B), g)
    theirs = torch.autograd.grad(_peft_update(x, lora), (x, lora.A, lora.B), g)
    assert torch.equal(ours[0], theirs[0])
    for mine, peft in zip(ours[1:], theirs[1:]):
        torch.testing.assert_close(mine, peft, rtol=1e-6, atol=1e-6)


def test_sliced_rows_give_the_same_update_and_gradients(monkeypatch):
    """Slices of 3 rows (the float32 copies bounded) against one slice: the same update, the gradients to float32
    rounding (the sums over slices are ordered otherwise), both within float32 of the fp64 oracle."""
    from lightning_memkit.ops import lora as lora_module

    lora = LoRAAdapter(16, 8, rank=2)
    torch.nn.init.normal_(lora.B)
    x = torch.randn(10, 16, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(10, 8, dtype=torch.bfloat16)
    whole = lora(x)
    whole_grads = torch.autograd.grad(whole, (x, lora.A, lora.B), g)
    monkeypatch.setattr(lora_module, "WIDE_SLICE_BYTES", 3 * 16 * 4)
    sliced = lora(x)
    sliced_grads = torch.autograd.grad(sliced, (x, lora.A, lora.B), g)
    assert torch.equal(sliced, whole) and torch.equal(sliced_grads[0], whole_grads[0])
    x64 = x.detach().double().requires_grad_()
    a64, b64 = lora.A.detach().double().requires_grad_(), lora.B.detach().double().requires_grad_()
    oracle = torch.autograd.grad(x64 @ a64.t() @ b64.t() * lora.scaling, (a64, b64), g.double())
    for mine, one, exact in zip(sliced_grads[1:], whole_grads[1:], oracle):
        torch.testing.assert_close(mine, one, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mine.double(), exact, rtol=1e-5, atol=1e-5)


def test_no_rows_routed_to_an_expert():
    from lightning_memkit.ops.lora import ExpertLoRAAdapter

    experts = ExpertLoRAAdapter(num_experts=2, in_features=8, out_features=4, rank=2)
    x = torch.zeros(0, 8, dtype=torch.bfloat16, requires_grad=True)
    out = experts(x, 1)
    out.float().sum().backward()
    assert out.shape == (0, 4) and torch.count_nonzero(experts.A.grad) == 0 and x.grad.shape == (0, 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_widens_one_slice_at_a_time_and_leaves_the_gradient_alone(monkeypatch, dtype):
    """An input of 4,096 x 512: backward's temporaries are one slice of 256 rows (the output gradient in float32,
    the input gradient in float32 and, bf16, rounded), not the whole input (8 MiB widened) or update."""
    from lightning_memkit.ops import lora as lora_module

    monkeypatch.setattr(lora_module, "WIDE_SLICE_BYTES", 256 * 512 * 4)
    lora = LoRAAdapter(512, 512, rank=8)
    x = torch.randn(4096, 512, dtype=dtype, requires_grad=True)
    out = lora(x)
    g = torch.randn_like(out)
    before = g.clone()
    with LivePeak() as lp:
        grads = torch.autograd.grad(out, (x, lora.A, lora.B), g)
        kept = sum(t.untyped_storage().nbytes() for t in grads)
    slice_f32 = 256 * 512 * 4
    assert lp.peak_bytes - kept < (2.6 if dtype == torch.bfloat16 else 2.1) * slice_f32
    assert torch.equal(g, before)  # scaled in a copy, never in the caller's tensor


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_under_activation_checkpointing_with_the_same_gradients(mode, monkeypatch):
    """Under selective checkpointing the saved matmul outputs are cached and must not be changed in place; sliced
    rows (3 per slice) too."""
    from lightning_memkit.ops import lora as lora_module
    from lightning_memkit.recompute.activation_recompute import checkpoint_modules

    monkeypatch.setattr(lora_module, "WIDE_SLICE_BYTES", 3 * 32 * 4)
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()).to(torch.bfloat16)
    block[0].requires_grad_(False)
    lora = LoRAAdapter(32, 32, rank=4)
    torch.nn.init.normal_(lora.B)
    net = torch.nn.ModuleDict({"block": block, "lora": lora})
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)

    def step():
        net.zero_grad(set_to_none=True)
        h = net["block"](x)
        (h + net["lora"](h)).float().square().sum().backward()
        return lora.A.grad.clone(), lora.B.grad.clone()

    plain = step()
    with checkpoint_modules([("lora", lora)], mode):
        recomputed = step()
    assert all(torch.equal(a, b) for a, b in zip(recomputed, plain))


@pytest.mark.parametrize("rows", [50, 49, 8])  # 7 rows a slice: alike slices and a shorter last one, or two
def test_on_fake_tensors_one_slice_stands_for_the_alike_ones(monkeypatch, rows):
    """An estimate runs one slice of each kind (their kept rows as one block) and counts the same peak in every phase,
    the same FLOPs and the same allocated bytes as the loop over every slice."""
    import lightning_memkit.ops.lora as lora
    from lightning_memkit.estimate.step import estimate_training_memory

    width = 32
    monkeypatch.setattr(lora, "WIDE_SLICE_BYTES", 4 * width * 7)

    class Adapted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.base = torch.nn.Linear(width, width), torch.nn.Linear(width, width).requires_grad_(False)
            self.a, self.b = torch.nn.Parameter(torch.randn(width, 4)), torch.nn.Parameter(torch.randn(4, width))

        def forward(self, x):
            x = self.inner(x)  # fake hidden states, as a decoder layer's
            return (self.base(x) + lora.low_rank_update(x, self.a, self.b, 0.5)).square().mean()

    def estimate():
        est = estimate_training_memory(Adapted, lambda: torch.randn(rows, width), loss_fn=lambda m, b: m(b))
        return [p.peak_bytes for p in est.phases], est.step_flops, est.step_bytes

    seen = []
    alike = lora.alike_runs
    monkeypatch.setattr(lora, "alike_runs", lambda stop, step, fake: seen.append(fake) or alike(stop, step, fake))
    standing = estimate()
    assert all(seen) and seen
    monkeypatch.setattr(lora, "alike_runs", lambda stop, step, fake: alike(stop, step, False))
    assert standing == estimate()
