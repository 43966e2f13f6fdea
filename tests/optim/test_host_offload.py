"""HostOffloadOptimizer: the configured optimizer's math, bitwise (gradients copied after backward or in it); no
optimizer state on the device and the host's bytes exactly the copies, buffers and state (LivePeak); the configured
optimizer's checkpoint format both ways; weights written between steps are copied again; refusals; the fake-tensor
estimate has no optimizer state on the device; on CUDA, the same losses with pinned buffers and a side stream."""

from __future__ import annotations

import pytest
import torch
from loops import adamw, assert_same_state, batches, chain, estimates, mlp, resumes_both_ways, run, train, two_groups

from lightning_memkit.measure.live_peak import LivePeak
from lightning_memkit.measure.storage import unique_storage_bytes
from lightning_memkit.optim import HostOffloadOptimizer, host_offload

CLASSES = [(torch.optim.AdamW, {}), (torch.optim.SGD, {"momentum": 0.9})]


@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize(("cls", "kwargs"), CLASSES, ids=["AdamW", "SGD"])
def test_the_same_steps_as_the_configured_optimizer_bitwise(cls, kwargs, offload_gradients):
    plain_losses, plain_state, plain_model = run(None, cls, **kwargs)
    losses, state, model = run(lambda o: HostOffloadOptimizer(o, offload_gradients=offload_gradients), cls, **kwargs)
    assert losses == plain_losses
    assert_same_state(state, plain_state)
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_the_device_holds_no_state_and_the_host_bytes_are_exact(offload_gradients):
    model = mlp(width=64)
    params = sum(p.numel() for p in model.parameters())
    with LivePeak() as lp:
        opt = HostOffloadOptimizer(two_groups(model), offload_gradients=offload_gradients)
        assert lp.host_live_bytes == 2 * 4 * params  # a copy of each parameter and its gradient buffer
        train(model, opt, batches(2))
    moments = 2 * 4 * params  # exp_avg, exp_avg_sq
    assert unique_storage_bytes(opt.host_optimizer.state) == moments + 4 * 4  # and a float32 step per parameter
    # LivePeak does not see the steps: torch.tensor(0.0) makes them from a Python number, outside the dispatcher
    assert lp.host_live_bytes == 2 * 4 * params + moments
    assert lp.live_bytes == 0  # on the device: no state, and the gradients are freed once on the host
    assert opt.state == {}  # nothing for Lightning to move to the device


def test_a_checkpoint_moves_between_runs_with_and_without_it():
    assert resumes_both_ways(HostOffloadOptimizer)


def test_the_state_is_taken_over_and_given_back():
    model = mlp()
    configured = two_groups(model)
    train(model, configured, batches(1))
    with LivePeak() as lp, HostOffloadOptimizer(configured) as opt:
        assert not configured.state and len(opt.host_optimizer.state) == 4
        assert lp.live_bytes == 0 and lp.host_live_bytes > 0
    assert sorted(configured.state[model[0].weight]) == ["exp_avg", "exp_avg_sq", "step"]


def test_weights_written_between_steps_are_copied_again():
    data = batches()
    model, plain = mlp(), mlp()
    opt, plain_opt = HostOffloadOptimizer(two_groups(model)), two_groups(plain)
    assert train(model, opt, data[:2]) == train(plain, plain_opt, data[:2])
    with torch.no_grad():  # e.g. weights loaded from a file
        for p, q in zip(model.parameters(), plain.parameters()):
            p.mul_(0.5)
            q.mul_(0.5)
    assert train(model, opt, data[2:]) == train(plain, plain_opt, data[2:])


def test_refusals():
    model = mlp()
    with pytest.raises(ValueError, match="HostOffloadOptimizer: LBFGS is not supported"):
        HostOffloadOptimizer(torch.optim.LBFGS(model.parameters()))
    with pytest.raises(TypeError, match=r"offload_gradients='yes'\) must be a bool"):
        HostOffloadOptimizer(two_groups(model), offload_gradients="yes")


def test_the_estimate_has_no_optimizer_state_on_the_device():
    plain, lever = estimates(adamw, host_offload)
    weights = 3 * 128 * 128 * 4
    assert lever.optimizer == "host_offload(adamw)"
    assert all(p.optimizer_state == 0 for p in lever.phases)
    assert plain.phases[1].optimizer_state == 2 * weights  # exp_avg, exp_avg_sq (not the steps, made by torch.tensor)
    # the forward: neither the state nor the last step's gradients (freed once copied) are on the device
    assert plain.phases[1].peak_bytes - lever.phases[1].peak_bytes == 3 * weights



@pytest.mark.parametrize("warmup", ["synthetic", "step"])
def test_under_accumulation_the_estimate_keeps_the_gradients_of_the_previous_micro_step(warmup):
    """A micro-step after the first runs with the gradients the one before left (the offload frees them only at
    the optimizer step): the estimate counts them, and its peak is the measured one of such a micro-step."""
    from lightning_memkit.estimate.step import estimate_training_memory

    width, rows = 128, 2
    args = (lambda: chain(width), lambda: torch.randn(rows, width))
    loss = lambda m, x: m(x).square().mean()  # noqa: E731
    est = estimate_training_memory(*args, optimizer=host_offload(adamw), loss_fn=loss, zero_grad="accumulate",
                                   warmup=warmup)
    weights = 3 * width * width * 4
    assert est.phases[1].gradients == weights  # alive through the forward
    with LivePeak() as lp:
        model = chain(width)
        opt = host_offload(adamw)(model)
        for _ in range(2):  # a first optimizer step of two micro-batches
            loss(model, torch.randn(rows, width)).backward()
        opt.step()
        opt.zero_grad()
        loss(model, torch.randn(rows, width)).backward()  # the next one's first: its gradients stay on the device
        lp.reset_peak()
        loss(model, torch.randn(rows, width)).backward()
        opt.step()
    assert lp.peak_bytes == est.peak_bytes


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_on_cuda_the_same_losses_with_pinned_buffers(offload_gradients):
    data = [x.cuda() for x in batches()]
    plain, model = mlp().cuda(), mlp().cuda()
    expected = train(plain, two_groups(plain), data)
    opt = HostOffloadOptimizer(two_groups(model), offload_gradients=offload_gradients)
    losses = train(model, opt, data)
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-6
    slot = next(iter(opt._slots.values()))
    assert slot.host.is_pinned() and slot.grad.is_pinned()
    assert all(t.device.type == "cpu" for s in opt.host_optimizer.state.values() for t in s.values())
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
