"""Measuring a ``torch.compile``d model: it stays compiled, and every byte count is right or says it is not."""

import pytest
import torch
from torch import nn
from torch._dynamo.backends.registry import lookup_backend
from torch.utils._python_dispatch import _disable_current_modes

from lightning_memkit.measure.allocator_peak import AllocatorPeak
from lightning_memkit.measure.compiled import compiled_parts, runs_compiled
from lightning_memkit.measure.live_peak import unmeasured as unmeasured_block
from lightning_memkit.measure.saved_tensors import SavedTensorRecorder
from lightning_memkit.memory import LivePeak, profile_saved_tensors


class Counting:
    """A dynamo backend: ``inner`` compiles each graph; counts the graphs compiled and the compiled calls run."""

    def __init__(self, inner="eager", hide_allocations=False):
        self.inner, self.hide = inner, hide_allocations
        self.graphs = self.calls = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        compiled = lookup_backend(self.inner)(gm, example_inputs)

        def run(*args):
            self.calls += 1
            if self.hide:  # allocate where no dispatch mode looks, as inductor's own buffers are
                with _disable_current_modes():
                    return compiled(*args)
            return compiled(*args)

        return run


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 8)

    def forward(self, x):
        return self.b(nn.functional.gelu(self.a(x)) * 2)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _net():
    torch.manual_seed(0)
    return Net(), torch.randn(32, 16)


def _step(model, x):
    model(x).sum().backward()


def _clear(net):
    for p in net.parameters():
        p.grad = None


def test_first_call_under_live_peak_compiles_and_later_calls_run_the_graph():
    net, x = _net()
    with LivePeak() as eager:
        _step(net, x)
    expected = (eager.peak_bytes, eager.live_bytes)  # the gradients stay alive
    backend = Counting("eager")  # runs the graph op by op: the dispatch mode sees what eager code allocates
    compiled = torch.compile(net, backend=backend)
    peaks = []
    for measured in (True, False, True):
        _clear(net)
        if measured:
            with LivePeak() as lp:
                _step(compiled, x)
            peaks.append((lp.peak_bytes, lp.live_bytes))
        else:
            _step(compiled, x)
    assert backend.graphs == 1 and backend.calls == 3  # compiled under the first LivePeak, never recompiled
    assert peaks == [expected] * 2 and expected[1] > 0  # the compiled step's bytes, counted exactly


def test_live_peak_counts_an_aot_compiled_step_as_the_allocator_does():
    net, x = _net()
    backend = Counting("aot_eager")
    compiled = torch.compile(net, backend=backend)
    _step(compiled, x)  # compiles forward and backward
    counts = []
    for _ in range(2):
        _clear(net)
        with LivePeak() as lp:
            _step(compiled, x)
        counts.append((lp.peak_bytes, lp.live_bytes, lp.is_tracked(net.a.weight.grad)))
    with AllocatorPeak() as ap:
        _clear(net)
        _step(compiled, x)
    assert backend.graphs == 1 and backend.calls == 4
    grads = sum(4 * p.numel() for p in net.parameters())
    assert counts[0] == counts[1] == (counts[0][0], grads, True)  # the compiled backward's gradients counted
    assert 0 < counts[0][0] <= ap.peak_bytes


def test_allocations_outside_the_dispatcher_are_missed_by_live_peak_and_counted_by_allocator_peak():
    net, x = _net()
    with AllocatorPeak() as eager:
        _step(net, x)
    backend = Counting("eager", hide_allocations=True)
    compiled = torch.compile(net, backend=backend)
    _clear(net)
    _step(compiled, x)
    _clear(net)
    with LivePeak() as lp:
        out = compiled(x)
        out.sum().backward()
    hidden = not lp.is_tracked(out)
    _clear(net)
    with AllocatorPeak() as ap:
        _step(compiled, x)
    assert backend.graphs == 1 and backend.calls == 3
    assert hidden and lp.peak_bytes < ap.peak_bytes  # the compiled forward's buffers were out of the mode's sight
    assert ap.complete and ap.peak_bytes == eager.peak_bytes


@pytest.mark.slow
def test_inductor_step_is_counted_by_allocator_peak_and_stays_compiled():
    net, x = _net()
    with AllocatorPeak() as eager:
        _step(net, x)
    backend = Counting("inductor")
    compiled = torch.compile(net, backend=backend)
    _clear(net)
    with LivePeak() as lp:
        out = compiled(x)
        out.sum().backward()
    hidden = not lp.is_tracked(out)
    _clear(net)
    with AllocatorPeak() as first:
        _step(compiled, x)
    for _ in range(2):
        _clear(net)
        with AllocatorPeak() as later:
            _step(compiled, x)
    assert backend.graphs == 1 and backend.calls == 4
    assert hidden  # inductor's output buffer: no dispatch mode sees it
    # the allocator sees inductor's buffers (the compile's own work excluded): within 10% of the eager step
    assert first.peak_bytes == later.peak_bytes and abs(later.peak_bytes - eager.peak_bytes) <= 0.1 * eager.peak_bytes


# -- AllocatorPeak ----------------------------------------------------------------------------------------------


def test_allocator_peak_ignores_frees_of_blocks_an_earlier_session_allocated():
    with AllocatorPeak():
        old = torch.empty(1000)  # 4000 bytes, seen by the earlier session
    with AllocatorPeak() as ap:
        a = torch.empty(100)  # 400
        del old  # existed before this block: its free must not lower the count
        b = torch.empty(500)  # 2000
    assert ap.peak_bytes == 2400
    del a, b


def test_a_nested_allocator_peak_makes_the_outer_one_incomplete_never_partial():
    with AllocatorPeak() as outer:
        a = torch.empty(100)
        with AllocatorPeak() as inner:
            b = torch.empty(1000)
        c = torch.empty(10)
    assert inner.complete and inner.peak_bytes == 4000
    assert not outer.complete and outer.peak_bytes is None
    del a, b, c


def test_allocator_peak_refuses_to_run_beside_a_foreign_profiler():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(RuntimeError, match="another torch.profiler session"):
            AllocatorPeak().__enter__()


def test_allocator_peak_skips_unmeasured_blocks_and_the_compile():
    with AllocatorPeak() as ap:
        a = torch.empty(100)  # 400
        with unmeasured_block():
            big = torch.empty(10_000)
            del big
            kept = torch.empty(10)  # alive after the block: counts (440)
    assert ap.peak_bytes == 440
    del a, kept
    net, x = _net()
    compiled = torch.compile(net, backend="aot_eager")
    with AllocatorPeak() as first:  # traces and compiles forward and backward inside the block
        _step(compiled, x)
    _clear(net)
    with AllocatorPeak() as later:
        _step(compiled, x)
    assert abs(first.peak_bytes - later.peak_bytes) <= 64  # what the compile keeps may count, not its peak


# -- saved tensors -----------------------------------------------------------------------------------------------


def _rows(report):
    return [(r.name, r.num_tensors, r.activation_bytes, r.weight_bytes) for r in report.rows]


def test_saved_tensor_profile_of_a_compiled_module_is_the_eager_one_and_the_module_stays_compiled():
    net, x = _net()
    x.requires_grad_(True)
    eager = profile_saved_tensors(net, x, backward=True)
    backend = Counting("eager")
    net.compile(backend=backend)  # in place: the module names stay
    profiled = profile_saved_tensors(net, x, backward=True)
    assert _rows(profiled) == _rows(eager) and len(profiled.rows) == 3  # per module, as eager
    assert profiled.peak_bytes == eager.peak_bytes
    assert backend.graphs == 0 and torch._dynamo.eval_frame._stance.stance == "default"  # ran eagerly, put back
    _step(net, x)
    assert (backend.graphs, backend.calls) == (1, 1)  # compiles on its first call outside the recorder
    again = profile_saved_tensors(net, x, backward=True)
    _step(net, x)
    assert (backend.graphs, backend.calls) == (1, 2)  # the profile ran eagerly; no recompile after it
    assert _rows(again) == _rows(eager)


def test_the_recorder_puts_the_stance_back_when_the_forward_raises():
    net, _ = _net()
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        with SavedTensorRecorder(net):
            net(torch.randn(2, 3))
    assert torch._dynamo.eval_frame._stance.stance == "default"


# -- which parts run compiled ------------------------------------------------------------------------------------


def test_compiled_parts_finds_every_way_of_compiling_a_module():
    outer = nn.Sequential(Net(), Net(), Net())
    assert compiled_parts(outer) == [] and not runs_compiled(outer)
    outer[0].compile(backend="eager")
    outer[1] = torch.compile(outer[1], backend="eager")
    step = torch.compile(outer[2].forward, backend="eager")
    outer[2].forward = step  # a compiled method set on the instance (Lightning does so for training_step)
    assert compiled_parts(outer) == ["0", "1", "2"] and runs_compiled(outer)
