import gc
import weakref

import pytest
import torch
from torch import nn

from lightning_memkit.memory import LivePeak, checkpoint_modules, is_checkpointed, select_modules
from lightning_memkit.memory.activation_recompute import resolve_policy


class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, scale=1.0):
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))) * scale


class Net(nn.Module):
    def __init__(self, n=3, d=32):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x, scale=0.5)
        return self.head(x)


def _step(net, x, seed=0):
    torch.manual_seed(seed)  # dropout: recomputation must replay the same mask
    net.zero_grad(set_to_none=True)
    with LivePeak() as lp:
        loss = net(x).square().mean()
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters()}, lp.peak_bytes


def test_gradients_equal_without_recomputation_and_peak_drops():
    net, x = Net(), torch.randn(16, 64, 32)
    loss0, grads0, peak0 = _step(net, x)
    with checkpoint_modules(select_modules(net, {Block})) as handle:
        assert handle.names == ["blocks.0", "blocks.1", "blocks.2"]
        loss1, grads1, peak1 = _step(net, x)
    assert torch.equal(loss0, loss1)
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=0, atol=1e-6, msg=name)
    assert peak1 < 0.6 * peak0


def test_state_dict_keys_and_forward_restored():
    net = Net()
    keys = list(net.state_dict())
    handle = checkpoint_modules(select_modules(net, f"{Block.__module__}.Block"))
    assert list(net.state_dict()) == keys and all(is_checkpointed(b) for b in net.blocks)
    handle.restore()
    assert all("forward" not in vars(b) for b in net.blocks) and not is_checkpointed(net.blocks[0])


def test_restored_on_exception():
    net = Net()
    with pytest.raises(RuntimeError, match="boom"):
        with checkpoint_modules(select_modules(net, {Block})):
            raise RuntimeError("boom")
    assert all("forward" not in vars(b) for b in net.blocks)


def test_no_grad_calls_forward_directly():
    net, x = Net().eval(), torch.randn(2, 4, 32)
    with torch.no_grad():
        ref = net(x)
        with checkpoint_modules(select_modules(net, {Block})):
            assert torch.equal(net(x), ref)


def test_callable_policy_nested_matches_and_double_wrap():
    net = Net()
    chosen = select_modules(net, lambda name, m: isinstance(m, (Block, nn.Linear)))
    assert [n for n, _ in chosen] == ["blocks.0", "blocks.1", "blocks.2", "head"]  # Linear inside Block skipped
    with checkpoint_modules(chosen):
        with pytest.raises(ValueError, match=r"module 'blocks.0' \(Block\) is already checkpointed"):
            checkpoint_modules(select_modules(net, {Block}))
        assert is_checkpointed(net.head)  # nothing half-applied by the failed call, nothing undone either
    assert not is_checkpointed(net.head)


def test_policy_matching_nothing_lists_the_classes():
    with pytest.raises(ValueError, match=r"matched no submodule of Net; its module classes are: .*Block.*Linear"):
        select_modules(Net(), {nn.Conv2d})


def test_policy_errors():
    with pytest.raises(ValueError, match="'no.such.Module' cannot be imported"):
        resolve_policy(["no.such.Module"])
    with pytest.raises(ValueError, match="'torch.zeros' is not a torch.nn.Module subclass"):
        resolve_policy("torch.zeros")
    with pytest.raises(TypeError, match="policy entries must be torch.nn.Module classes"):
        resolve_policy([3])
    with pytest.raises(TypeError, match="policy must be a module class"):
        resolve_policy(3)
    with pytest.raises(ValueError, match="policy is empty"):
        resolve_policy([])


def test_handle_holds_modules_weakly():
    net = Net()
    handle = checkpoint_modules(select_modules(net, {Block}))
    ref = weakref.ref(net)
    del net
    gc.collect()
    assert ref() is None and handle.names == []
    handle.restore()
