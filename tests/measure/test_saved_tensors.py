import json

import pytest
import torch
from torch import nn

from lightning_memkit.measure import live_peak as live_peak_module
from lightning_memkit.measure.saved_tensors import SavedTensorRecorder
from lightning_memkit.measure.storage import iter_tensors, storage_key
from lightning_memkit.memory import LivePeak, SavedTensorReport, SavedTensorRow, profile_saved_tensors


def nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def live_bytes_without_output(module, *args) -> int:
    """The oracle: LivePeak.live_bytes around one forward, output storages excluded."""
    with LivePeak() as lp:
        out = module(*args)
    out_keys = {storage_key(t) for t in iter_tensors(out)}
    return lp.live_bytes - sum(n for key, n, _, _ in lp.live_storages() if key in out_keys)


def rows(report: SavedTensorReport) -> dict[str, SavedTensorRow]:
    return {r.name: r for r in report.rows}


class StashExp(torch.autograd.Function):
    """Keeps exp(x) as a plain ctx attribute: no saved-tensor hook ever sees it."""

    @staticmethod
    def forward(ctx, x):
        ctx.some_attr = x.exp()
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.some_attr


class StashBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return StashExp.apply(self.fc(x))


class StashNet(nn.Module):
    def __init__(self, width: int = 32, n: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(StashBlock(width) for _ in range(n))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_linear_saved_input_counts_as_preexisting_activation():
    lin = nn.Linear(16, 8)
    x = torch.randn(4, 16)
    report = profile_saved_tensors(lin, x)
    (row,) = report.rows
    assert row.name == "" and row.label == "(root)"
    # the input is what Linear keeps to compute the weight gradient; the weight itself is not needed
    assert row.activation_bytes == nbytes(x) == report.preexisting_bytes
    assert row.weight_bytes == 0 and row.num_tensors == 1
    assert report.new_activation_bytes == 0 == live_bytes_without_output(lin, x)


@pytest.mark.parametrize("as_buffer", [False, True])
def test_frozen_weight_saved_for_input_grad_counts_as_weight(as_buffer):
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            w = torch.randn(32, 16)
            if as_buffer:
                self.register_buffer("w", w)
            else:
                self.w = nn.Parameter(w, requires_grad=False)

        def forward(self, x):
            return x @ self.w.t()

    m = Frozen()
    x = torch.randn(4, 16, requires_grad=True)
    report = profile_saved_tensors(m, x)
    assert report.total_weight_bytes == nbytes(m.w) == 32 * 16 * 4
    assert report.total_activation_bytes == 0  # x is not needed: the weight takes no gradient
    assert live_bytes_without_output(m, x) == 0  # and LivePeak sees no new memory for it
    assert [s.kind for s in report.storages] == ["weight"]


def test_mlp_bytes_per_layer_exact():
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(8, 16)
    report = profile_saved_tensors(mlp, x)
    by = rows(report)
    assert list(by) == ["0", "1", "2"]  # model order
    assert by["0"].activation_bytes == nbytes(x)  # Linear keeps its input
    assert by["1"].activation_bytes == 8 * 32 * 4  # ReLU keeps its output ...
    assert by["2"].activation_bytes == 0  # ... which the next Linear also saves: counted once
    assert by["2"].num_tensors == 2  # that shared input and the weight (needed for the input's gradient)
    assert by["2"].weight_bytes == nbytes(mlp[2].weight)
    assert report.total_weight_bytes == nbytes(mlp[2].weight)
    assert report.preexisting_bytes == nbytes(x)
    assert report.new_activation_bytes == live_bytes_without_output(mlp, x) == 8 * 32 * 4


def test_output_shared_storage_is_counted_and_reported():
    net = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid())  # sigmoid saves its result, which is the output
    x = torch.randn(5, 8)
    report = profile_saved_tensors(net, x)
    assert report.output_bytes == 5 * 8 * 4
    assert rows(report)["1"].activation_bytes == 5 * 8 * 4
    assert report.new_activation_bytes == live_bytes_without_output(net, x) == 0


def test_ctx_stash_agrees_with_live_peak_and_hooks_alone_would_miss_it():
    net = StashNet(width=32, n=3)
    x = torch.randn(16, 32)
    oracle = live_bytes_without_output(net, x)
    report = profile_saved_tensors(net, x)
    assert oracle > 0
    assert report.new_activation_bytes == pytest.approx(oracle, rel=0.05)  # the acceptance criterion
    assert report.new_activation_bytes == oracle  # and on CPU the count is in fact exact
    stash = 16 * 32 * 4
    assert report.stashed_bytes == 3 * stash
    for i in range(3):
        assert rows(report)[f"blocks.{i}"].stashed_bytes == stash  # the module running the Function
    assert all(s.stashed == (s.name.count(".") == 1) for s in report.storages)
    hooks_only = report.new_activation_bytes - report.stashed_bytes
    assert hooks_only < 0.95 * oracle


def test_depth_groups_rows_and_keeps_totals():
    net = StashNet(width=16, n=2)
    x = torch.randn(4, 16)
    full = profile_saved_tensors(net, x)
    grouped = profile_saved_tensors(net, x, depth=2)
    assert {r.name for r in full.rows} >= {"blocks.0", "blocks.0.fc", "blocks.1.fc", "head"}
    assert [r.name for r in grouped.rows] == ["blocks.0", "blocks.1", "head"]
    for attr in ("activation_bytes", "weight_bytes", "stashed_bytes", "num_tensors"):
        assert sum(getattr(r, attr) for r in grouped.rows) == sum(getattr(r, attr) for r in full.rows)
    assert grouped.total_activation_bytes == full.total_activation_bytes
    g0 = rows(grouped)["blocks.0"]
    f = rows(full)
    assert g0.activation_bytes == f["blocks.0"].activation_bytes + f["blocks.0.fc"].activation_bytes


def test_backward_peak_and_grads_left_as_found():
    net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    x = torch.randn(16, 32)
    fwd = profile_saved_tensors(net, x)
    assert fwd.peak_bytes is None
    calls = []

    def loss_fn(out):
        calls.append(out.shape)
        return out.pow(2).mean()

    report = profile_saved_tensors(net, x, backward=True, loss_fn=loss_fn)
    assert calls == [torch.Size([16, 8])]
    assert report.peak_bytes is not None
    # backward allocates every parameter gradient while saved activations are still partly alive
    grads = sum(p.numel() * 4 for p in net.parameters())
    assert report.peak_bytes >= report.forward_peak_bytes
    assert report.peak_bytes >= grads
    assert all(p.grad is None for p in net.parameters())
    assert report.total_activation_bytes == fwd.total_activation_bytes


def test_grad_mode_off_is_an_error():
    lin = nn.Linear(4, 4)
    with torch.no_grad(), pytest.raises(RuntimeError, match="grad mode"):
        profile_saved_tensors(lin, torch.randn(2, 4))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="grad mode"):
        profile_saved_tensors(lin, torch.randn(2, 4))


def test_argument_errors():
    with pytest.raises(ValueError, match="depth"):
        profile_saved_tensors(nn.Linear(2, 2), torch.randn(1, 2), depth=0)
    with pytest.raises(TypeError, match="module"):
        profile_saved_tensors(lambda x: x, torch.randn(1, 2))
    with pytest.raises(TypeError, match="loss_fn"):
        profile_saved_tensors(nn.Linear(2, 2), torch.randn(1, 2), backward=True, loss_fn=3)
    with pytest.raises(RuntimeError, match="requires grad|require grad"):
        frozen = nn.Linear(2, 2).requires_grad_(False)
        profile_saved_tensors(frozen, torch.randn(1, 2), backward=True)


class CountingRecorder(SavedTensorRecorder):
    packs = 0

    def _pack(self, t):
        CountingRecorder.packs += 1
        return super()._pack(t)


def test_everything_removed_when_forward_raises():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            self.fc(x)
            raise ValueError("boom")

    net = Boom()
    rec = CountingRecorder(net)
    with pytest.raises(ValueError, match="boom"), rec:
        net(torch.randn(2, 4))
    assert CountingRecorder.packs > 0
    packs = CountingRecorder.packs
    for m in net.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert live_peak_module._ACTIVE == []
    net.fc(torch.randn(2, 4))  # no pack hook left behind
    assert CountingRecorder.packs == packs
    with pytest.raises(RuntimeError, match="once"):
        rec.__enter__()
    with pytest.raises(RuntimeError, match="raised"):
        rec.report()


def test_quantized_parameter_storages_count_as_weight():
    bnb = pytest.importorskip("bitsandbytes")

    class Q(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False).to("cpu")

        def forward(self, x):
            mask = self.w.view(torch.bool).flatten()[: x.shape[-1]]  # a view of the packed 4-bit storage
            absmax = self.w.quant_state.absmax[: x.shape[-1]]  # a side tensor of the quantized parameter
            return torch.where(mask, x, 0.0) * absmax

    q = Q()
    assert q.w.bnb_quantized and q.w.dtype == torch.uint8
    x = torch.randn(3, 16, requires_grad=True)
    report = profile_saved_tensors(q, x)
    assert report.total_weight_bytes == nbytes(q.w) + nbytes(q.w.quant_state.absmax)
    assert report.total_activation_bytes == 0


def test_report_renders_and_serialises():
    net = StashNet(width=8, n=1)
    report = profile_saved_tensors(net, torch.randn(2, 8), backward=True, depth=1)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["total_activation_bytes"] == report.total_activation_bytes
    assert data["peak_bytes"] == report.peak_bytes
    assert data["rows"][0] == {
        "name": "blocks", "num_tensors": report.rows[0].num_tensors,
        "activation_bytes": report.rows[0].activation_bytes, "weight_bytes": report.rows[0].weight_bytes,
        "stashed_bytes": report.rows[0].stashed_bytes,
    }
    assert sum(s["nbytes"] for s in data["storages"]) == report.total_activation_bytes + report.total_weight_bytes
    text = str(report)
    assert text.splitlines()[0].split() == ["module", "tensors", "activation", "stashed", "weight"]
    assert f"({report.peak_bytes} bytes)" in text
    from rich.console import Console
    from rich.table import Table

    table = report.table(max_rows=1)
    assert isinstance(table, Table)
    console = Console(width=200, record=True)
    console.print(table)
    rendered = console.export_text()
    by_size = sorted(report.rows, key=lambda r: r.total_bytes)
    assert by_size[-1].label in rendered and by_size[0].label not in rendered
    assert "1 smaller rows" in rendered


def test_recorder_holds_module_weakly():
    import gc
    import weakref

    net = nn.Linear(3, 3)
    ref = weakref.ref(net)
    with SavedTensorRecorder(net) as rec:
        out = net(torch.randn(2, 3))
        rec.stop()
    report = rec.report(output=out)
    del net, out
    gc.collect()
    assert ref() is None
    assert report.rows[0].activation_bytes == 2 * 3 * 4  # the input, created inside the block
    assert report.preexisting_bytes == 0 and report.stashed_bytes == 0
    # without the output, the live scan cannot tell the output from a stash
    assert rec.report().stashed_bytes == 2 * 3 * 4


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_is_seen_and_agrees(use_reentrant):
    from torch.utils.checkpoint import checkpoint

    class Ckpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
            self.b = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

        def forward(self, x):
            return checkpoint(self.b, self.a(x) + 1, use_reentrant=use_reentrant)

    m = Ckpt()
    x = torch.randn(16, 32)
    report = profile_saved_tensors(m, x)
    assert report.new_activation_bytes == live_bytes_without_output(m, x)
    assert not any(r.name.startswith("b.") for r in report.rows)  # nothing inside the checkpoint is kept
    assert rows(report)["a.1"].activation_bytes == 16 * 64 * 4


@pytest.mark.cuda
def test_cuda_counts_match_the_allocator():
    dev = torch.device("cuda", torch.cuda.current_device())
    net = StashNet(width=256, n=2).to(dev)
    x = torch.randn(128, 256, device=dev)  # every tensor here is a multiple of the allocator's 512-byte blocks
    net(x)  # warm-up: library workspaces are allocated once
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    out = net(x)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated(dev) - before - out.untyped_storage().nbytes()
    del out
    report = profile_saved_tensors(net, x)
    assert report.new_activation_bytes == live_bytes_without_output(net, x)
    assert report.new_activation_bytes == pytest.approx(allocated, rel=0.05)
    assert report.stashed_bytes == 2 * 128 * 256 * 4
    assert {s.device for s in report.storages} == {str(dev)}


def test_recorder_closes_under_a_live_peak_opened_after_it():
    # two callbacks each holding a tracker close in list order, not in reverse order of opening
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    lin = nn.Linear(8, 8)
    rec = SavedTensorRecorder(lin)
    rec.__enter__()
    outer = LivePeak()
    outer.__enter__()
    out = lin(torch.randn(2, 8))
    rec.__exit__(None, None, None)
    after = torch.empty(100)  # the later tracker still counts
    assert outer.is_tracked(after) and not rec.live_peak.is_tracked(after)
    outer.__exit__(None, None, None)
    assert _get_current_dispatch_mode_stack() == [] and live_peak_module._ACTIVE == []
    assert rec.report(output=out).rows[0].activation_bytes == 2 * 8 * 4
