import gc
import weakref

import pytest
import torch
from torch import nn

from lightning_memkit.memory import LivePeak, checkpoint_modules, is_checkpointed, select_modules
from lightning_memkit.recompute.activation_recompute import SAVED_OPS, recompute_mode, resolve_policy


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


def test_selective_keeps_the_matmul_outputs_exactly():
    """After forward: none keeps fc1, gelu and fc2 outputs; selective the two matmul outputs; full the output only."""
    n, d = 8, 16
    mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
    x = torch.randn(n, d, requires_grad=True)
    kept, grads = {}, {}
    for mode in (None, "selective", "full"):
        handle = checkpoint_modules([("mlp", mlp)], mode=mode) if mode else checkpoint_modules([])
        with handle, LivePeak() as lp:
            out = mlp(x)
            kept[mode] = lp.live_bytes
            out.square().sum().backward()
        grads[mode] = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
        x.grad = None
        mlp.zero_grad(set_to_none=True)
    unit = n * d * 4  # one (n, d) float32 tensor
    assert kept == {None: 9 * unit, "selective": 5 * unit, "full": unit}  # (4+4+1), (4+1), 1
    for mode in ("selective", "full"):
        for a, b in zip(grads[mode], grads[None]):
            assert torch.equal(a, b)


def test_selective_gradients_equal_and_peak_between_full_and_none():
    net, x = Net(), torch.randn(16, 64, 32)
    loss0, grads0, peak0 = _step(net, x)
    with checkpoint_modules(select_modules(net, {Block}), mode="selective") as handle:
        assert handle.modes == dict.fromkeys(["blocks.0", "blocks.1", "blocks.2"], "selective")
        assert [recompute_mode(b) for b in net.blocks] == ["selective"] * 3
        loss1, grads1, peak1 = _step(net, x)  # dropout is recomputed: its mask must replay
    with checkpoint_modules(select_modules(net, {Block})):
        _, _, peak_full = _step(net, x)
    assert torch.equal(loss0, loss1)
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=0, atol=1e-6, msg=name)
    assert peak_full < peak1 < peak0
    assert recompute_mode(net.blocks[0]) is None


def test_mixed_modes_and_mode_errors():
    net = Net()
    chosen = select_modules(net, {Block})
    with checkpoint_modules(chosen, mode={"blocks.0": "full", "blocks.1": "selective", "blocks.2": "full"}) as h:
        assert [recompute_mode(b) for b in net.blocks] == ["full", "selective", "full"]
        assert h.modes["blocks.1"] == "selective"
    with pytest.raises(ValueError, match=r"mode\['blocks.0'\]='fast' is not a recompute mode; allowed: 'full', "):
        checkpoint_modules(chosen, mode={"blocks.0": "fast", "blocks.1": "full", "blocks.2": "full"})
    with pytest.raises(ValueError, match=r"mode\['blocks.0'\]='partial' is not a recompute mode"):
        checkpoint_modules(chosen, mode="partial")
    with pytest.raises(ValueError, match=r"mode must give a mode for each module and no other: missing \['blocks.2'\]"):
        checkpoint_modules(chosen, mode={"blocks.0": "full", "blocks.1": "full"})
    with pytest.raises(TypeError, match="mode must be 'full', 'selective' or a mapping name -> mode, got int"):
        checkpoint_modules(chosen, mode=1)
    assert not any(is_checkpointed(b) for b in net.blocks)  # nothing half-applied


def test_saved_ops_cover_matmuls_and_attention():
    assert {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default} <= SAVED_OPS
    assert torch.ops.aten.gelu.default not in SAVED_OPS
