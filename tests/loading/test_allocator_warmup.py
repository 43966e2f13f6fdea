import logging
import sys
import types

import pytest
import torch

from lightning_memkit.loading.allocator_warmup import ENV_VAR, parse_warmup_mode, warmup_cap_bytes
from lightning_memkit.memory import (
    LivePeak,
    WarmupDecision,
    effective_device_memory,
    guard_allocator_warmup,
    warmup_decision,
)

GiB = 2**30

# A stand-in for transformers.modeling_utils: the warmup looks its byte counter up as a module global, as
# the real one does, and records what it would reserve.
_FAKE_SOURCE = """
from collections import defaultdict

seen = []

def get_total_byte_count(model, device_map, hf_quantizer=None):
    counts = defaultdict(int)
    for name, dev in device_map.items():
        counts[dev] += model[name]
    return counts

def caching_allocator_warmup(model, device_map, hf_quantizer):
    counts = get_total_byte_count(model, device_map, hf_quantizer)
    seen.append(dict(counts))
    return "ran"
"""


@pytest.fixture
def fake(monkeypatch):
    mod = types.ModuleType("memkit_fake_loader")
    exec(_FAKE_SOURCE, mod.__dict__)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    mod.target = f"{mod.__name__}.caching_allocator_warmup"
    return mod


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def _mock_cuda(monkeypatch, totals, current=1, fractions=None, free=None, reserved=None):
    """Pretend there are len(totals) GPUs; device ``current`` is active."""
    fractions = fractions or {}

    class Props:
        def __init__(self, i):
            self.total_memory = totals[i]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props(i))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: fractions.get(i, 1.0))
    if free is not None:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (free[i], totals[i]))
    if reserved is not None:
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: reserved[i])


# -- modes -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, mode",
    [("on", "on"), ("ON", "on"), ("1", "on"), ("True", "on"), ("enable", "on"),
     ("off", "off"), ("0", "off"), ("FALSE", "off"), ("Disable", "off"), ("auto", "auto"), ("Cap", "cap")],
)
def test_mode_from_env_and_argument(monkeypatch, raw, mode):
    monkeypatch.setenv(ENV_VAR, raw)
    assert parse_warmup_mode(None) == (mode, ENV_VAR)
    assert warmup_decision("cpu").mode == mode
    assert parse_warmup_mode(raw) == (mode, "mode argument")


def test_mode_defaults_to_auto_and_argument_beats_env(monkeypatch):
    assert parse_warmup_mode(None) == ("auto", "default")
    monkeypatch.setenv(ENV_VAR, "off")
    assert warmup_decision("cpu", mode="on").skip is False


def test_invalid_modes_name_value_and_allowed(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "sometimes")
    allowed = r"allowed: on, off, auto, cap \(or 1, 0, true, false, enable, disable"
    with pytest.raises(ValueError, match=rf"MEMKIT_ALLOCATOR_WARMUP='sometimes' is not a warmup mode; {allowed}"):
        warmup_decision("cpu")
    with pytest.raises(ValueError, match="MEMKIT_ALLOCATOR_WARMUP='sometimes'"):
        guard_allocator_warmup()  # validated at construction, never a silent auto
    monkeypatch.delenv(ENV_VAR)
    with pytest.raises(ValueError, match=rf"mode='yes please' is not a warmup mode; {allowed}"):
        warmup_decision("cpu", mode="yes please")
    with pytest.raises(TypeError, match="mode must be a str, bool or None, got int"):
        warmup_decision("cpu", mode=3)


def test_invalid_numbers_and_target():
    with pytest.raises(ValueError, match=r"warmup_decision\(threshold_bytes=-1\): must be an int >= 0"):
        warmup_decision("cpu", threshold_bytes=-1)
    with pytest.raises(TypeError, match=r"guard_allocator_warmup\(margin_bytes=1.5\): must be an int >= 0, got float"):
        guard_allocator_warmup(margin_bytes=1.5)
    with pytest.raises(ValueError, match="target='nodot' must name a module attribute"):
        guard_allocator_warmup(target="nodot")
    with pytest.raises(ValueError, match="device='gpu0'"):
        guard_allocator_warmup(device="gpu0")


# -- decisions under mocked devices --------------------------------------------------------------------


def test_auto_uses_the_active_device_not_device_0(monkeypatch):
    _mock_cuda(monkeypatch, totals=[80 * GiB, 16 * GiB], current=1)
    d = warmup_decision()
    assert isinstance(d, WarmupDecision)
    assert (d.device, d.effective_bytes, d.skip) == ("cuda:1", 16 * GiB, True)
    assert "cuda:1 may use 16.00 GiB" in d.reason and "warmup skipped" in d.reason
    d0 = warmup_decision("cuda:0")
    assert (d0.device, d0.effective_bytes, d0.skip) == ("cuda:0", 80 * GiB, False)


def test_auto_applies_the_per_process_fraction(monkeypatch):
    _mock_cuda(monkeypatch, totals=[80 * GiB, 80 * GiB], current=1, fractions={1: 0.25})
    d = warmup_decision()
    assert d.effective_bytes == 20 * GiB and d.skip
    assert "fraction 0.25" in d.reason
    assert not warmup_decision(threshold_bytes=20 * GiB).skip  # not below the threshold
    assert not warmup_decision("cuda:0").skip


def test_unknown_memory_keeps_the_warmup(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    d = warmup_decision("cuda:1")
    assert d.skip is False and d.effective_bytes is None
    assert "memory of cuda:1 unknown, warmup kept" in d.reason


def test_on_off_ignore_memory(monkeypatch):
    _mock_cuda(monkeypatch, totals=[1 * GiB, 1 * GiB])
    assert warmup_decision(mode="on").skip is False
    assert warmup_decision(mode="off").skip is True


@pytest.mark.parametrize(
    "free, fraction, reserved, margin",
    [(30 * GiB, 1.0, 1 * GiB, 2 * GiB),  # limited by free memory on the card
     (70 * GiB, 0.25, 3 * GiB, 1 * GiB),  # limited by the per-process fraction
     (1 * GiB, 1.0, 0, 2 * GiB)],  # margin larger than what is left: 0
)
def test_cap_is_free_or_fraction_minus_margin(monkeypatch, free, fraction, reserved, margin):
    total = 80 * GiB
    _mock_cuda(monkeypatch, totals=[8 * GiB, total], current=1, fractions={1: fraction},
               free={0: 0, 1: free}, reserved={0: 0, 1: reserved})
    expected = max(0, min(free, int(total * fraction) - reserved) - margin)
    assert warmup_cap_bytes(None, margin) == expected
    d = warmup_decision(mode="cap", margin_bytes=margin)
    assert (d.skip, d.cap_bytes, d.device) == (False, expected, "cuda:1")


# -- the scoped wrapper ----------------------------------------------------------------------------------


def test_guard_wraps_only_while_active_and_records_calls(fake):
    original = fake.caching_allocator_warmup
    with guard_allocator_warmup(fake.target, mode="off", device="cpu") as g:
        assert fake.caching_allocator_warmup is not original
        assert fake.caching_allocator_warmup({"w": 8}, {"w": "cpu"}, None) is None
        assert fake.seen == []  # skipped: the real body never ran
    assert fake.caching_allocator_warmup is original
    assert [c.skip for c in g.calls] == [True] and g.decision.mode == "off"
    with guard_allocator_warmup(fake.target, mode="on", device="cpu"):
        assert fake.caching_allocator_warmup({"w": 8}, {"w": "cpu"}, None) == "ran"
    assert fake.seen == [{"cpu": 8}]


def test_restored_on_exception(fake):
    original = fake.caching_allocator_warmup
    with pytest.raises(RuntimeError, match="boom"):
        with guard_allocator_warmup(fake.target, mode="off"):
            raise RuntimeError("boom")
    assert fake.caching_allocator_warmup is original


def test_nesting_and_double_use_never_double_wrap(fake):
    original = fake.caching_allocator_warmup
    outer = guard_allocator_warmup(fake.target, mode="off", device="cpu")
    inner = guard_allocator_warmup(fake.target, mode="on", device="cpu")
    with outer:
        wrapper = fake.caching_allocator_warmup
        with outer:  # the same guard again
            assert fake.caching_allocator_warmup is wrapper
        assert fake.caching_allocator_warmup is wrapper and outer.active
        with inner:  # innermost decides, same wrapper
            assert fake.caching_allocator_warmup is wrapper
            assert fake.caching_allocator_warmup.__wrapped__ is original
            assert fake.caching_allocator_warmup({"w": 4}, {"w": "cpu"}, None) == "ran"
        assert fake.caching_allocator_warmup({"w": 4}, {"w": "cpu"}, None) is None
    assert fake.caching_allocator_warmup is original
    assert fake.seen == [{"cpu": 4}]


def test_activate_is_idempotent_and_release_order_is_free(fake):
    original = fake.caching_allocator_warmup
    a = guard_allocator_warmup(fake.target, mode="off")
    b = guard_allocator_warmup(fake.target, mode="on")
    a.activate()
    a.activate()
    b.activate()
    a.release()  # a leaves first: b still holds the one wrapper
    assert fake.caching_allocator_warmup is not original and not a.active
    b.release()
    b.release()
    assert fake.caching_allocator_warmup is original


def test_not_installed_is_a_noop_with_debug_log(caplog):
    caplog.set_level(logging.DEBUG, logger="lightning_memkit")
    with guard_allocator_warmup("memkit_no_such_package.modeling.warmup", mode="off") as g:
        pass
    assert g.installed is False
    assert "memkit_no_such_package.modeling not importable" in caplog.text


def test_missing_function_and_cap_without_byte_counter_are_errors(fake):
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        with guard_allocator_warmup(f"{fake.__name__}.nope"):
            pass
    del fake.get_total_byte_count
    original = fake.caching_allocator_warmup
    with pytest.raises(ValueError, match="mode='cap' needs memkit_fake_loader.get_total_byte_count"):
        with guard_allocator_warmup(fake.target, mode="cap"):
            pass
    assert fake.caching_allocator_warmup is original  # nothing half-applied


def test_replaced_meanwhile_is_left_alone(fake, caplog):
    other = lambda *a: "other"
    with guard_allocator_warmup(fake.target, mode="off"):
        fake.caching_allocator_warmup = other
    assert fake.caching_allocator_warmup is other
    assert "replaced by other code" in caplog.text


def test_cap_limits_the_byte_count_and_restores_it(fake):
    counter = fake.get_total_byte_count
    cap = 4096
    margin = effective_device_memory("cpu") - cap
    with guard_allocator_warmup(fake.target, mode="cap", device="cpu", margin_bytes=margin) as g:
        fake.caching_allocator_warmup({"a": 10_000, "b": 100}, {"a": "cpu", "b": "cpu"}, None)
        fake.caching_allocator_warmup({"b": 100}, {"b": "cpu"}, None)
        assert fake.get_total_byte_count is counter  # patched only during the call
    assert fake.seen == [{"cpu": cap}, {"cpu": 100}]
    assert g.calls[0].cap_bytes == cap


# -- the real transformers function ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture
def hf_warmup_on_cpu(monkeypatch):
    """Make ``from_pretrained(device_map="cpu")`` reach the real warmup and let it allocate on the CPU.

    Without ``accelerate`` installed, transformers refuses any ``device_map`` (and only calls the warmup
    when one is given): the availability check is forced to True. ``is_accelerator_device`` is widened to
    count the CPU, so the real ``caching_allocator_warmup`` sizes its block with ``get_total_byte_count`` and
    reserves it with ``torch.empty`` on the CPU, where ``LivePeak`` measures it exactly. A measuring spy is
    put at the module attribute first; the guard then wraps the spy, so ``blocks`` shows whether and how
    big the real function's allocation was.
    """
    pytest.importorskip("transformers")
    import transformers.integrations.accelerate as hf_accelerate
    import transformers.modeling_utils as mu

    monkeypatch.setattr(hf_accelerate, "is_accelerate_available", lambda: True)
    monkeypatch.setattr(mu, "is_accelerator_device", lambda d: d != "disk" and torch.device(d).type != "meta")
    real = mu.caching_allocator_warmup
    blocks = []

    def spy(*args, **kwargs):
        with LivePeak() as lp:
            real(*args, **kwargs)
        blocks.append(lp.peak_bytes)

    monkeypatch.setattr(mu, "caching_allocator_warmup", spy)
    return mu, blocks


def _model_bytes(model):
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def test_from_pretrained_calls_the_module_global(tiny_llama, hf_warmup_on_cpu):
    from transformers import LlamaForCausalLM

    mu, blocks = hf_warmup_on_cpu
    with guard_allocator_warmup(mode="on", device="cpu") as g:
        model = LlamaForCausalLM.from_pretrained(tiny_llama, device_map="cpu")
    assert len(g.calls) == 1 and not g.calls[0].skip
    assert blocks == [_model_bytes(model)]  # the real function reserved the whole model once


@pytest.mark.parametrize("mode", ["off", "auto-skip", "auto-keep", "cap"])
def test_from_pretrained_skips_or_caps_as_decided(tiny_llama, hf_warmup_on_cpu, mode):
    from transformers import LlamaForCausalLM

    mu, blocks = hf_warmup_on_cpu
    cpu_memory = effective_device_memory("cpu")
    kwargs = {
        "off": {"mode": "off"},
        "auto-skip": {"mode": "auto", "threshold_bytes": cpu_memory + 1},
        "auto-keep": {"mode": "auto", "threshold_bytes": 0},
        "cap": {"mode": "cap", "margin_bytes": cpu_memory - 10_000},
    }[mode]
    with guard_allocator_warmup(device="cpu", **kwargs) as g:
        model = LlamaForCausalLM.from_pretrained(tiny_llama, device_map="cpu")
    full = _model_bytes(model)
    assert len(g.calls) == 1
    if mode in ("off", "auto-skip"):
        assert g.calls[0].skip and blocks == []  # the real function was never reached
    elif mode == "auto-keep":
        assert blocks == [full]
    else:
        assert full > 10_000 and blocks == [10_000]  # reached, block capped (fp16 elements: even bytes)
    assert mu.caching_allocator_warmup.__name__ == "spy"  # restored


@pytest.mark.cuda
def test_capped_gpu_warmup_no_longer_fails(monkeypatch):
    """The reported failure: the warmup reserves the whole model although the process may use less."""
    transformers = pytest.importorskip("transformers")
    import transformers.modeling_utils as mu

    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                   num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=32)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)  # about 2.5 GiB of fp32 parameters, none allocated
    device_map = {name: dev for name in model.state_dict()}
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(dev).total_memory
    fraction = (torch.cuda.memory_reserved(dev) + 1 * GiB) / total  # this process may reserve ~1 GiB more
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            mu.caching_allocator_warmup(model, device_map, None)
        torch.cuda.empty_cache()
        with guard_allocator_warmup(mode="auto", device=dev) as g:
            mu.caching_allocator_warmup(model, device_map, None)
        assert g.calls[0].skip
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        with guard_allocator_warmup(mode="cap", device=dev, margin_bytes=256 * 2**20) as g:
            mu.caching_allocator_warmup(model, device_map, None)
        assert 0 < torch.cuda.max_memory_allocated(dev) - base <= g.calls[0].cap_bytes
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.empty_cache()
