"""``guard_allocator_warmup`` used from several threads at once.

Real threads, with every interleaving forced by a step sequencer (no sleeps): the warmup function (and, in
``cap`` mode, the byte counter it sizes its block with) is patched while any guard is active and is the
exact original object once all have left, exceptions included; each thread's own innermost guard decides
for the calls that thread makes.
"""

import sys
import threading
import types
from collections.abc import Callable

import pytest

from lightning_memkit.loading.allocator_warmup import ENV_VAR
from lightning_memkit.memory import effective_device_memory, guard_allocator_warmup

TIMEOUT = 20.0

# A stand-in for transformers.modeling_utils, as in tests/loading/test_allocator_warmup.py, with a hook the
# test uses to stop a thread inside the warmup call (after the guard's wrapper has run, before the byte
# counter is read, and again after it was read).
_FAKE_SOURCE = """
from collections import defaultdict

def hook(where):
    pass

def get_total_byte_count(model, device_map, hf_quantizer=None):
    counts = defaultdict(int)
    for name, dev in device_map.items():
        counts[dev] += model[name]
    return counts

def caching_allocator_warmup(model, device_map, hf_quantizer):
    hook("enter")
    counts = get_total_byte_count(model, device_map, hf_quantizer)
    hook("exit")
    return dict(counts)
"""


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    mod = types.ModuleType("memkit_fake_thread_loader")
    exec(_FAKE_SOURCE, mod.__dict__)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    mod.target = f"{mod.__name__}.caching_allocator_warmup"
    mod.original = mod.caching_allocator_warmup
    mod.counter = mod.get_total_byte_count
    return mod


class Sequencer:
    """Runs numbered steps one at a time, in order, whichever thread owns each step."""

    def __init__(self) -> None:
        self.next = 0
        self.cond = threading.Condition()

    def step(self, n: int, action: Callable[[], object] = lambda: None):
        with self.cond:
            if not self.cond.wait_for(lambda: self.next == n, timeout=TIMEOUT):
                raise TimeoutError(f"step {n} never came (at step {self.next})")
        try:
            return action()
        finally:
            with self.cond:
                self.next += 1
                self.cond.notify_all()


def run_threads(*targets: Callable[[], None]) -> None:
    """Run each target in its own thread; re-raise the first failure here (a hang fails, never stalls)."""
    errors: list[BaseException] = []

    def wrap(fn):
        def body():
            try:
                fn()
            except BaseException as err:  # noqa: BLE001 - handed to the main thread
                errors.append(err)

        return body

    threads = [threading.Thread(target=wrap(t), name=f"memkit-test-{i}") for i, t in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def _call(fake, size: int = 8):
    return fake.caching_allocator_warmup({"w": size}, {"w": "cpu"}, None)


def _patched(fake) -> bool:
    return fake.caching_allocator_warmup is not fake.original


# -- two guards, one per thread, overlapping in every order ----------------------------------------------


@pytest.mark.parametrize("first_out", ["A", "B"])
def test_overlapping_guards_patch_while_any_is_active_and_each_thread_keeps_its_own(fake, first_out):
    """A enters (off), B enters (on), then A or B leaves first; each call follows the caller's own guard."""
    seq = Sequencer()
    modes = {"A": "off", "B": "on"}
    expect = {"off": None, "on": {"cpu": 8}}
    last = "B" if first_out == "A" else "A"
    out: dict[str, list] = {"A": [], "B": []}

    def thread(name):
        def body():
            rec = out[name].append
            g = guard_allocator_warmup(fake.target, mode=modes[name], device="cpu")
            seq.step(0 if name == "A" else 1, g.__enter__)  # 0: A enters, 1: B enters
            seq.step(2 if name == "A" else 3, lambda: rec(("both active", _patched(fake), _call(fake))))
            if name == first_out:
                seq.step(4, lambda: g.__exit__(None, None, None))
                seq.step(5, lambda: rec(("other active", _patched(fake), _call(fake))))
            else:
                seq.step(6, lambda: rec(("alone", _patched(fake), _call(fake))))
                seq.step(7, lambda: g.__exit__(None, None, None))
                seq.step(8, lambda: rec(("none active", _patched(fake), fake.caching_allocator_warmup)))
            assert len(g.calls) == (2 if name == last else 1)

        return body

    run_threads(thread("A"), thread("B"))
    assert out[first_out] == [("both active", True, expect[modes[first_out]]),
                              ("other active", True, {"cpu": 8})]  # no guard of its own left: unchanged
    assert out[last] == [("both active", True, expect[modes[last]]),
                         ("alone", True, expect[modes[last]]),
                         ("none active", False, fake.original)]
    assert fake.caching_allocator_warmup is fake.original


def test_nested_guards_per_thread_and_a_thread_without_a_guard(fake):
    """Each thread's innermost guard decides for it; a thread with no guard of its own is not affected."""
    seq = Sequencer()
    out: dict[str, list] = {"A": [], "B": [], "C": []}

    def a():
        with guard_allocator_warmup(fake.target, mode="off", device="cpu"):
            seq.step(0, lambda: out["A"].append(_call(fake)))  # None
            with guard_allocator_warmup(fake.target, mode="on", device="cpu"):
                seq.step(3, lambda: out["A"].append(_call(fake)))  # ran: A's inner guard
                seq.step(4)
            seq.step(6, lambda: out["A"].append(_call(fake)))  # None again: A's outer guard
            seq.step(8)

    def b():
        seq.step(1)
        with guard_allocator_warmup(fake.target, mode="on", device="cpu"):
            with guard_allocator_warmup(fake.target, mode="off", device="cpu"):
                seq.step(2, lambda: out["B"].append(_call(fake)))  # None: B's inner guard
                seq.step(5, lambda: out["B"].append(_call(fake)))  # None, whatever A did meanwhile
            seq.step(7, lambda: out["B"].append(_call(fake)))  # ran: B's outer guard
            seq.step(9)

    def c():
        seq.step(10, lambda: out["C"].append((_patched(fake), _call(fake))))  # no guard in C: unchanged

    run_threads(a, b, c)
    assert out["A"] == [None, {"cpu": 8}, None]
    assert out["B"] == [None, None, {"cpu": 8}]
    assert out["C"] == [(False, {"cpu": 8})]
    assert fake.caching_allocator_warmup is fake.original


def test_an_exception_in_one_thread_releases_only_its_guard(fake):
    seq = Sequencer()
    out: dict[str, object] = {}

    def a():
        with guard_allocator_warmup(fake.target, mode="off", device="cpu"):
            seq.step(0)
            seq.step(3, lambda: out.__setitem__("A call after B failed", _call(fake)))
            seq.step(4, lambda: out.__setitem__("patched while A active", _patched(fake)))
        seq.step(5, lambda: out.__setitem__("patched after all", _patched(fake)))

    def b():
        seq.step(1)
        with pytest.raises(RuntimeError, match="load failed"):
            with guard_allocator_warmup(fake.target, mode="on", device="cpu"):
                seq.step(2, lambda: out.__setitem__("B call", _call(fake)))
                raise RuntimeError("load failed")

    run_threads(a, b)
    assert out == {"B call": {"cpu": 8}, "A call after B failed": None, "patched while A active": True,
                   "patched after all": False}
    assert fake.caching_allocator_warmup is fake.original


def test_exception_in_the_last_guard_restores_the_original(fake):
    seq = Sequencer()

    def a():
        with guard_allocator_warmup(fake.target, mode="off", device="cpu"):
            seq.step(0)
            seq.step(2)

    def b():
        seq.step(1)
        with pytest.raises(KeyError):
            with guard_allocator_warmup(fake.target, mode="on", device="cpu"):
                seq.step(3)  # A has left: B holds the only guard
                raise KeyError("boom")

    run_threads(a, b)
    assert fake.caching_allocator_warmup is fake.original


def test_activate_in_one_thread_release_in_another(fake):
    """The Lightning callback may be released from another thread than the one that activated it."""
    guard = guard_allocator_warmup(fake.target, mode="off", device="cpu")
    run_threads(guard.activate)
    assert guard.active and _patched(fake)
    assert _call(fake) == {"cpu": 8}  # this thread has no guard of its own
    run_threads(guard.release)
    assert not guard.active and fake.caching_allocator_warmup is fake.original


# -- cap mode: the byte counter is patched only during calls, and calls overlap --------------------------


@pytest.mark.parametrize("first_out", ["A", "B"])
def test_overlapping_cap_calls_each_use_their_own_cap_and_restore_the_counter(fake, first_out):
    """Both threads are inside the warmup at once; each sizes its block with its own guard's cap."""
    cpu = effective_device_memory("cpu")
    caps = {"A": 4096, "B": 1024}
    seq = Sequencer()
    steps = {  # per thread: (hook "enter", hook "exit" = reads the counter and returns, after the call)
        "A": (0, 2, 3) if first_out == "A" else (0, 4, 5),
        "B": (1, 4, 5) if first_out == "A" else (1, 2, 3),
    }
    out: dict[str, object] = {}
    local = threading.local()

    def hook(where):
        enter, leave, _ = steps[local.name]
        seq.step(enter if where == "enter" else leave)

    fake.hook = hook

    def thread(name):
        def body():
            local.name = name
            with guard_allocator_warmup(fake.target, mode="cap", device="cpu", margin_bytes=cpu - caps[name]) as g:
                out[name] = _call(fake, size=10_000)
                seq.step(steps[name][2], lambda: out.__setitem__(f"{name} counter after its call",
                                                                   fake.get_total_byte_count is fake.counter))
            assert [c.cap_bytes for c in g.calls] == [caps[name]]

        return body

    run_threads(thread("A"), thread("B"))
    assert out["A"] == {"cpu": caps["A"]} and out["B"] == {"cpu": caps["B"]}
    assert out[f"{first_out} counter after its call"] is False  # the other call still runs capped
    last = "B" if first_out == "A" else "A"
    assert out[f"{last} counter after its call"] is True
    assert fake.get_total_byte_count is fake.counter
    assert fake.caching_allocator_warmup is fake.original


def test_cap_in_one_thread_does_not_cap_another_threads_call(fake):
    """While A is inside a capped call, B's uncapped (mode on) call reads the true byte count."""
    cpu = effective_device_memory("cpu")
    seq = Sequencer()
    out: dict[str, object] = {}
    local = threading.local()
    steps = {"A": (0, 3), "B": (1, 2)}
    fake.hook = lambda where: seq.step(steps[local.name][0 if where == "enter" else 1])

    def thread(name, **kw):
        def body():
            local.name = name
            with guard_allocator_warmup(fake.target, device="cpu", **kw):
                out[name] = _call(fake, size=10_000)

        return body

    run_threads(thread("A", mode="cap", margin_bytes=cpu - 100), thread("B", mode="on"))
    assert out == {"A": {"cpu": 100}, "B": {"cpu": 10_000}}
    assert fake.get_total_byte_count is fake.counter and fake.caching_allocator_warmup is fake.original


# -- many threads, no forced order ------------------------------------------------------------------------


def test_many_threads_churn(fake):
    start = threading.Barrier(8, timeout=TIMEOUT)
    wrong: list[tuple] = []

    def worker(i):
        def body():
            outer_mode, inner_mode = ("off", "on") if i % 2 else ("on", "off")
            start.wait()
            for _ in range(50):
                with guard_allocator_warmup(fake.target, mode=outer_mode, device="cpu"):
                    r = _call(fake)
                    if (r is None) != (outer_mode == "off"):
                        wrong.append((i, "outer", r))
                    with guard_allocator_warmup(fake.target, mode=inner_mode, device="cpu"):
                        r = _call(fake)
                        if (r is None) != (inner_mode == "off"):
                            wrong.append((i, "inner", r))

        return body

    run_threads(*(worker(i) for i in range(8)))
    assert wrong == []
    assert fake.caching_allocator_warmup is fake.original
