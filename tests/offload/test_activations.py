"""offload_activations: gradients bitwise equal, bytes moved to host exactly as LivePeak counts them, composition with
checkpoint_modules in either order, what is never offloaded, restore, errors; CUDA streams and prefetch on a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_memkit.demo import TinyLM
from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
from lightning_memkit.hf.layers import decoder_layers
from lightning_memkit.measure.live_peak import HOST
from lightning_memkit.memory import LivePeak, checkpoint_modules, is_checkpointed
from lightning_memkit.offload import is_offloaded, offload_activations, offload_blocks
from lightning_memkit.recompute.activation_recompute import repeated_blocks

MODES = (None, "full", "selective")


def tiny_lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(d_model=32, n_layers=3, n_heads=2, seq_len=32)


def lm_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (4, 33), generator=g)
    return ids[:, :-1], ids[:, 1:]


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def step(model: nn.Module, batch, loss_fn=lm_loss, device: str = "cpu"):
    """One forward and backward under LivePeak: loss, gradients, the tracker."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with LivePeak() as lp:
        loss = loss_fn(model, batch)
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, lp


def assert_bitwise(a, b) -> None:
    loss_a, grads_a, _ = a
    loss_b, grads_b, _ = b
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


@pytest.mark.parametrize("mode", MODES)
def test_tiny_lm_gradients_bitwise_equal_and_host_bytes_exact(mode):
    model, batch = tiny_lm(), lm_batch()
    blocks = repeated_blocks(model)
    with checkpoint_modules(blocks, mode=mode) if mode else _nothing():
        reference = step(model, batch)
        with offload_activations(blocks, root=model) as handle:
            handle.reset_stats()
            offloaded = step(model, batch)
            stats = handle.stats()
    assert_bitwise(offloaded, reference)
    live = offloaded[2]
    assert stats.tensors > 0 and stats.host_live_bytes == 0  # every host copy freed with the graph
    assert live.host_peak_bytes == stats.bytes == stats.host_peak_bytes  # all alive at the end of the forward
    assert live.by_device[HOST].live == 0
    if mode is None:
        assert live.peak_bytes < reference[2].peak_bytes
    if mode == "full":  # a checkpointed block keeps its input: one (4, 32, 32) float32 tensor per block
        assert (stats.tensors, stats.bytes) == (3, 3 * 4 * 32 * 32 * 4)


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_peak_drops_with_checkpointing_when_the_inputs_matter():
    """Offloaded checkpointing: with the checkpointed blocks' inputs alive at the loss, their bytes leave the peak."""
    torch.manual_seed(0)
    model = TinyLM(d_model=32, n_layers=6, n_heads=2, seq_len=64)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (16, 65), generator=g)
    batch = ids[:, :-1], ids[:, 1:]
    blocks = repeated_blocks(model)
    with checkpoint_modules(blocks):
        reference = step(model, batch)
        with offload_activations(blocks, root=model) as handle:
            offloaded = step(model, batch)
    assert_bitwise(offloaded, reference)
    assert handle.stats().bytes == 6 * 16 * 64 * 32 * 4
    assert offloaded[2].peak_bytes < reference[2].peak_bytes


def hf_model(family: str, peft: bool = False) -> nn.Module:
    model = tiny_hf_causal_lm(family, seed=0, num_layers=2, use_cache=False)
    if peft:
        from peft import LoraConfig, get_peft_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model


def hf_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family, peft", [("llama", False), ("qwen3_moe", False), ("llama", True)],
                         ids=["llama", "qwen3_moe", "peft-llama"])
def test_hf_decoder_layers_gradients_bitwise_equal(family, peft, mode):
    pytest.importorskip("peft" if peft else "transformers")
    model = hf_model(family, peft)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(2))
    layers = decoder_layers(model)
    assert len(layers) == 2
    with checkpoint_modules(layers, mode=mode) if mode else _nothing():
        reference = step(model, ids, hf_loss)
        with offload_activations(layers, root=model) as handle:
            offloaded = step(model, ids, hf_loss)
    assert_bitwise(offloaded, reference)
    assert handle.stats().tensors > 0 and offloaded[2].host_peak_bytes == handle.stats().bytes
    if mode is None:
        assert offloaded[2].peak_bytes < reference[2].peak_bytes


@pytest.mark.parametrize("offload_first", [False, True], ids=["checkpoint-first", "offload-first"])
def test_either_order_and_restoring_either_leaves_the_other_working(offload_first):
    model, batch = tiny_lm(), lm_batch()
    blocks = repeated_blocks(model)
    plain = step(model, batch)
    with checkpoint_modules(blocks):
        checkpointed = step(model, batch)
    offload = lambda: offload_activations(blocks, root=model)
    recompute = lambda: checkpoint_modules(blocks)
    first, second = (offload(), recompute()) if offload_first else (recompute(), offload())
    handles = {"offload": first if offload_first else second, "recompute": second if offload_first else first}
    assert_bitwise(step(model, batch), checkpointed)
    assert handles["offload"].stats().bytes == 3 * 4 * 32 * 32 * 4  # inputs only: the blocks are checkpointed
    handles["recompute"].restore()  # offload alone now: every saved activation goes
    assert not any(is_checkpointed(b) for _, b in blocks) and all(is_offloaded(b) for _, b in blocks)
    handles["offload"].reset_stats()
    assert_bitwise(step(model, batch), plain)
    assert handles["offload"].stats().bytes > 3 * 4 * 32 * 32 * 4
    handles["offload"].restore()
    with checkpoint_modules(blocks), offload_activations(blocks, root=model) as again:
        again.restore()  # recompute alone
        assert_bitwise(step(model, batch), checkpointed)
        assert again.stats().tensors == 0 and all(is_checkpointed(b) for _, b in blocks)
    assert not any(is_offloaded(b) or is_checkpointed(b) for _, b in blocks)


def test_nothing_is_offloaded_without_grad_mode():
    model, batch = tiny_lm(), lm_batch()
    with offload_activations(repeated_blocks(model), root=model) as handle, LivePeak() as lp:
        with torch.no_grad():
            model(batch[0])
        with torch.inference_mode():
            model(batch[0])
    assert handle.stats().tensors == 0 and lp.host_peak_bytes == 0


class Shared(nn.Module):
    """A block saving a view of its own weight, a root-level parameter and a buffer, besides two activations."""

    def __init__(self, root_scale: nn.Parameter):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))
        self.register_buffer("mask", torch.rand(16))
        self.root_scale = [root_scale]  # not registered here: the root owns it

    def forward(self, x):
        y = x @ self.w.t()  # saves x and a view of w
        z = y * self.root_scale[0].view(16)  # saves y and a view of the root's parameter
        return z * self.mask  # saves the buffer only (z's gradient needs mask; mask needs none)


def test_parameters_buffers_and_their_views_are_never_offloaded():
    root = nn.Module()
    root.scale = nn.Parameter(torch.randn(16))
    root.block = Shared(root.scale)
    x = torch.randn(8, 16, requires_grad=True)  # 512 bytes
    with offload_activations([("block", root.block)], root=root, min_bytes=0) as handle, LivePeak() as lp:
        root.block(x).sum().backward()
    assert handle.stats().tensors == 2 and lp.host_peak_bytes == handle.stats().bytes == 2 * 8 * 16 * 4  # x, y
    with offload_activations([("block", root.block)], min_bytes=0) as handle:  # no root: the view of its parameter
        root.block(x).sum().backward()
    assert (handle.stats().tensors, handle.stats().bytes) == (3, 2 * 8 * 16 * 4 + 16 * 4)


def test_small_tensors_stay_and_a_tensor_saved_twice_gets_one_copy():
    square = nn.Module()
    square.forward = lambda x: (x * x).tanh()  # mul saves x twice; tanh saves its output
    x = torch.randn(4, 64, requires_grad=True)  # 1 KiB each
    reference = torch.autograd.grad(square(x).sum(), x)[0]
    with offload_activations([square], min_bytes=1024) as handle:
        square(x).sum().backward()
    assert (handle.stats().tensors, handle.stats().bytes) == (2, 2048)
    assert torch.equal(x.grad, reference)
    with offload_activations([square], min_bytes=1025) as handle:
        square(x).sum().backward()
    assert handle.stats().tensors == 0


def test_strided_views_come_back_with_their_strides():
    """A transposed (dense) view keeps its strides on the host; a view with gaps is copied compactly (its own
    bytes only) and comes back in its strides; an expanded tensor (overlapping elements) stays."""
    seen = []

    def forward(x):
        t = x.t()  # dense, transposed
        gap = x[:, ::2]  # gaps
        wide = x[:1].expand(64, 64)  # overlapping
        out = t.exp() * 1.0 + (gap * gap).sum() + (wide * wide).sum()
        return out

    block = nn.Module()
    block.forward = forward
    x = torch.randn(64, 64, requires_grad=True)
    reference = torch.autograd.grad(forward(x).sum(), x)[0]
    with offload_activations([block], min_bytes=0) as handle, LivePeak() as lp:
        out = block(x).sum()
        seen.append(handle.stats().bytes)
        grad = torch.autograd.grad(out, x)[0]
    assert torch.equal(grad, reference)
    # exp's output (64 x 64, transposed strides) and gap (64 x 32, saved twice: one copy); wide overlaps: it stays
    assert seen[0] == lp.host_peak_bytes == (64 * 64 + 64 * 32) * 4


def test_retain_graph_and_a_second_backward_give_the_same_gradients():
    model, batch = tiny_lm(), lm_batch()
    blocks = repeated_blocks(model)
    loss = lm_loss(model, batch)
    loss.backward(retain_graph=True)
    loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with offload_activations(blocks, root=model) as handle:
        loss = lm_loss(model, batch)
        loss.backward(retain_graph=True)
        assert handle.stats().host_live_bytes == handle.stats().bytes > 0  # kept for the second backward
        loss.backward()
        del loss
    assert handle.stats().host_live_bytes == 0
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, reference[n]), n


def test_restored_on_exception_in_the_block_and_around_it():
    model, batch = tiny_lm(), lm_batch()
    blocks = repeated_blocks(model)

    def boom(_module, _args):
        raise RuntimeError("boom")

    with offload_activations(blocks, root=model) as handle:
        hook = blocks[1][1].register_forward_pre_hook(boom)  # after ours: raised while our saved-tensor hooks are on
        with pytest.raises(RuntimeError, match="boom"):
            model(batch[0])
        hook.remove()
        handle.reset_stats()
        a = torch.randn(64, 64, requires_grad=True)
        (a * 2).exp().sum().backward()  # outside the blocks: nothing may be packed by a call left open
        assert handle.stats().tensors == 0
    with pytest.raises(RuntimeError, match="boom"):
        with offload_activations(blocks, root=model):
            raise RuntimeError("boom")
    assert not any(is_offloaded(b) for _, b in blocks)
    assert not any(b._forward_pre_hooks or b._forward_hooks for _, b in blocks)


def test_tensors_offloaded_before_restore_still_come_back():
    model, batch = tiny_lm(), lm_batch()
    reference = step(model, batch)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    handle = offload_activations(repeated_blocks(model), root=model)
    loss = lm_loss(model, batch)
    handle.restore()
    loss.backward()
    assert all(torch.equal(p.grad, reference[1][n]) for n, p in model.named_parameters())


def test_blocks_are_held_weakly():
    import gc
    import weakref

    model = tiny_lm()
    handle = offload_blocks(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None and handle.names == []
    handle.restore()


def test_bad_arguments_are_named():
    block = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"min_bytes=-1\) must be an int >= 0"):
        offload_activations([block], min_bytes=-1)
    with pytest.raises(TypeError, match=r"min_bytes=...\) must be an int >= 0, got float"):
        offload_activations([block], min_bytes=1.5)
    with pytest.raises(TypeError, match=r"prefetch=...\) must be a bool, got str"):
        offload_activations([block], prefetch="yes")
    with pytest.raises(TypeError, match=r"root=...\) must be a torch.nn.Module or None, got int"):
        offload_activations([block], root=1)
    with pytest.raises(TypeError, match="module '0' must be a torch.nn.Module, got str"):
        offload_activations(["block"])
    with pytest.raises(ValueError, match="the same module is given twice"):
        offload_activations([block, block])
    with offload_activations([block]):
        other = nn.Linear(2, 2)
        with pytest.raises(ValueError, match=r"module '1' \(Linear\) already offloads its activations"):
            offload_activations([other, block])
        assert not is_offloaded(other) and not other._forward_pre_hooks  # validated first: nothing half-applied
    with pytest.raises(ValueError, match="offload_blocks: Linear has no nn.ModuleList of same-class blocks"):
        offload_blocks(block)
    with pytest.raises(TypeError, match=r"offload_blocks\(model=...\) must be a torch.nn.Module, got str"):
        offload_blocks("model")


# -- CUDA: pinned host memory, side stream, prefetch -----------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_gradients_bitwise_equal_and_device_memory_lower(mode, prefetch):
    model, batch = tiny_lm().cuda(), tuple(t.cuda() for t in lm_batch())
    blocks = repeated_blocks(model)
    with checkpoint_modules(blocks, mode=mode) if mode else _nothing():
        step(model, batch)  # warm-up: cuBLAS workspaces, allocator pools
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        reference = step(model, batch)
        reference_peak = torch.cuda.max_memory_allocated() - base
        with offload_activations(blocks, root=model, prefetch=prefetch) as handle:
            step(model, batch)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            handle.reset_stats()
            offloaded = step(model, batch)
            peak = torch.cuda.max_memory_allocated() - base
    assert_bitwise(offloaded, reference)
    stats = handle.stats()
    assert stats.tensors > 0 and offloaded[2].host_peak_bytes == stats.bytes
    assert offloaded[2].peak_bytes < reference[2].peak_bytes or mode is not None
    if mode is None:
        assert peak < reference_peak


@pytest.mark.cuda
def test_cuda_host_copies_are_pinned_and_prefetch_fetches_the_block_before():
    from lightning_memkit.offload import activations

    model, batch = tiny_lm().cuda(), tuple(t.cuda() for t in lm_batch())
    blocks = repeated_blocks(model)
    with checkpoint_modules(blocks), offload_activations(blocks, root=model) as handle:
        loss = lm_loss(model, batch)
        frame = handle._last()
        packed = [r() for r in frame.items]
        assert packed and all(p.host.is_pinned() and p.ready is None for p in packed)
        previous = [r() for r in frame.prev().items]
        unpacked = packed[0].unpack()  # the last block's input: starts the copies of the block before
        assert torch.equal(unpacked.cpu(), packed[0].host)
        assert all(p.ready is not None for p in previous)
        del unpacked
        loss.backward()
        torch.cuda.synchronize()
    assert activations.is_offloaded(blocks[0][1]) is False
