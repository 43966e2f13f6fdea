"""EightBitAdamW: trains like AdamW (the loss falls along the float32 run's, within a stated tolerance); the state's
bytes are eight_bit_state_bytes (LivePeak on CPU, and the storages themselves); the configured groups'
hyperparameters, LR scheduler included; refusals; its own checkpoints resume, float32 ones are refused; the
fake-tensor estimate runs it."""

from __future__ import annotations

import pytest
import torch
from loops import adamw, batches, chain, estimates, mlp, train, two_groups

from lightning_memkit.measure.live_peak import LivePeak
from lightning_memkit.measure.storage import unique_storage_bytes
from lightning_memkit.optim import EightBitAdamW, eight_bit, eight_bit_state_bytes

MAPS = 2 * 256 * 4  # bitsandbytes' two quantization maps


def _regression(wrap, steps: int = 24) -> list[float]:
    """Fit :func:`mlp` (width 128) to a fixed linear map: the losses of each step."""
    model = mlp(width=128)
    torch.manual_seed(5)
    target = torch.nn.Linear(8, 4).requires_grad_(False)
    optimizer = two_groups(model)
    optimizer = wrap(optimizer) if wrap else optimizer
    losses = []
    for x in torch.randn(steps, 32, 8):
        def closure(x=x):
            loss = (model(x) - target(x)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            return loss

        losses.append(float(optimizer.step(closure).detach()))
    return losses


def test_it_trains_like_adamw():
    plain = _regression(None)
    losses = _regression(lambda o: EightBitAdamW(o, min_8bit_size=0))  # every parameter 8-bit
    assert losses != plain  # other numerics ...
    assert losses[-1] < 0.1 * losses[0]  # ... the loss falls ...
    # ... along the float32 run's. The moments are quantized block-wise with a dynamic 8-bit map: about 1% relative
    # error near a block's largest value, so each update m / sqrt(v) differs by about a percent, and the losses differ
    # by a small fraction of what the steps take off the loss (0.06% observed over these 24 steps); 2% is allowed
    assert max(abs(a - b) for a, b in zip(losses, plain)) < 0.02 * (plain[0] - plain[-1])


def test_the_state_bytes_are_the_formula():
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 3))  # 10000 + 100 + 300 + 3
    with LivePeak() as lp:
        opt = EightBitAdamW(two_groups(model))
        train(model, opt, [torch.randn(2, 100)])
        opt.zero_grad()
    expected = 2 * 10_000 + 2 * 4 * 40 + 8 * (100 + 300 + 3) + MAPS  # only the 100x100 weight has 8-bit moments
    assert eight_bit_state_bytes(model.parameters()) == expected
    assert unique_storage_bytes(opt.state) == expected
    # LivePeak does not see the maps: bitsandbytes makes them from Python lists (torch.tensor), outside the dispatcher
    assert lp.live_bytes == expected - MAPS
    assert eight_bit_state_bytes(model.parameters(), min_8bit_size=0) == 2 * 10_403 + 8 * (40 + 1 + 2 + 1) + MAPS


def test_the_configured_hyperparameters_and_the_scheduler_reach_it():
    model = mlp()
    configured = torch.optim.AdamW([{"params": model[0].parameters(), "weight_decay": 0.1, "betas": (0.8, 0.9)},
                                    {"params": model[2].parameters(), "eps": 1e-6}], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(configured, 1, gamma=0.5)
    opt = EightBitAdamW(configured)
    train(model, opt, batches(2), scheduler)
    inner = opt.eight_bit.param_groups
    assert [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in inner] == [
        (5e-3, (0.8, 0.9), 1e-8, 0.1), (5e-3, (0.9, 0.999), 1e-6, 1e-2)]  # read before the second step
    assert opt.param_groups is configured.param_groups


def test_its_checkpoint_resumes_and_a_float32_one_is_refused():
    data = batches(4)
    model = mlp()
    straight = train(model, EightBitAdamW(two_groups(model)), data)
    model = mlp()
    opt = EightBitAdamW(two_groups(model))
    losses = train(model, opt, data[:2])
    resumed = EightBitAdamW(two_groups(model))
    resumed.load_state_dict(opt.state_dict())
    assert losses + train(model, resumed, data[2:]) == straight
    plain = two_groups(model)
    train(model, plain, data[:1])
    with pytest.raises(ValueError, match="float32 Adam/AdamW's"):
        resumed.load_state_dict(plain.state_dict())


@pytest.mark.parametrize(("make", "match"), [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), "only torch.optim.Adam and AdamW .* got SGD"),
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "amsgrad=True"),
    (lambda ps: torch.optim.Adam(ps, maximize=True), "maximize=True"),
    (lambda ps: torch.optim.Adam(ps, weight_decay=0.1), "L2, added to the gradient"),
])
def test_refusals(make, match):
    with pytest.raises(ValueError, match=match):
        EightBitAdamW(make(mlp().parameters()))


def test_bad_arguments_and_state_already_there():
    model = mlp()
    with pytest.raises(ValueError, match=r"min_8bit_size=-1\): must be an int >= 0"):
        EightBitAdamW(two_groups(model), min_8bit_size=-1)
    with pytest.raises(ValueError, match=r"eight_bit\(min_8bit_size=-1\)"):
        eight_bit(two_groups, min_8bit_size=-1)
    configured = two_groups(model)
    train(model, configured, batches(1))
    with pytest.raises(ValueError, match="has float32 state already"):
        EightBitAdamW(configured)
    assert EightBitAdamW(torch.optim.Adam(model.parameters(), weight_decay=0.1, decoupled_weight_decay=True))


def test_the_estimate_runs_it_on_fake_tensors():
    plain, lever = estimates(adamw, eight_bit)
    expected = eight_bit_state_bytes(chain().parameters()) - MAPS  # the maps are real tensors, made from lists
    assert lever.optimizer == "eight_bit(adamw)"
    assert [p.optimizer_state for p in lever.phases[1:]] == [expected] * 3
    assert plain.phases[1].optimizer_state - expected == 2 * 3 * 128 * 128 * 4 - 3 * (2 * 128 * 128 + 8 * 64)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_its_kernels_give_the_state_bytes():
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 3)).cuda()
    opt = EightBitAdamW(two_groups(model))
    train(model, opt, [torch.randn(2, 100, device="cuda") for _ in range(3)])
    assert unique_storage_bytes(opt.state) == eight_bit_state_bytes(model.parameters())
    assert all(t.device.type == "cuda" for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
