import pytest
import torch

from lightning_memkit.memory import DeferredFree, LivePeak, UnsafeReleaseError
from lightning_memkit.release.storage_release import is_released


class FakeWork:
    """A torch.distributed.Work look-alike."""

    def __init__(self):
        self.completed = False
        self.waited = 0

    def is_completed(self):
        return self.completed

    def wait(self):
        self.waited += 1
        self.completed = True
        return True


class FakeEvent:
    """A torch.cuda.Event look-alike (query/synchronize)."""

    def __init__(self, done=False):
        self.done_ = done

    def query(self):
        return self.done_

    def synchronize(self):
        self.done_ = True


def _buf(n):
    return torch.randn(n)  # a communication buffer


def test_releases_when_ready_and_counts_bytes():
    free = DeferredFree()
    work, event = FakeWork(), FakeEvent()
    a, b, c = _buf(10), _buf(20), _buf(30)
    with LivePeak() as lp:
        d = _buf(40)
        free.defer(a, after=None)
        free.defer(b, after=work)
        free.defer(c, after=event)
        free.defer(d, after=None)
        assert free.drain() == (10 + 40) * 4
        assert lp.live_bytes == 0  # d was created in the block and is now released
    assert is_released(a) and not is_released(b) and not is_released(c)
    assert len(free) == 2
    work.completed = True
    assert free.drain() == 20 * 4 and len(free) == 1
    assert free.drain(wait=True) == 30 * 4
    assert event.done_ and len(free) == 0 and free.released_bytes == 100 * 4


def test_wait_waits_for_every_handle():
    free = DeferredFree()
    works = [FakeWork() for _ in range(3)]
    bufs = [_buf(4) for _ in works]
    for t, w in zip(bufs, works):
        free.defer(t, after=w)
    assert free.drain() == 0
    assert free.drain(wait=True) == 3 * 16
    assert all(w.waited == 1 for w in works)


def test_future_handle():
    fut = torch.futures.Future()
    free = DeferredFree()
    t = _buf(8)
    free.defer(t, after=fut)
    assert free.drain() == 0
    fut.set_result(None)
    assert free.drain() == 32


def test_bad_arguments():
    free = DeferredFree()
    with pytest.raises(TypeError, match="after= must be None, a work handle"):
        free.defer(_buf(3), after=object())
    with pytest.raises(ValueError, match="leaf that requires grad"):
        free.defer(torch.randn(3, requires_grad=True))
    with pytest.raises(ValueError, match="is a parameter"):
        free.defer(torch.nn.Parameter(torch.randn(3)))
    with pytest.raises(TypeError, match="check=...\\) must be a bool"):
        DeferredFree(check=1)
    with pytest.raises(TypeError, match="poison=...\\) must be None or a bool"):
        DeferredFree(poison="yes")
    assert len(free) == 0


def test_refused_release_releases_nothing():
    w = torch.randn(3, 2, requires_grad=True)
    ok, saved = _buf(3), torch.randn(3, requires_grad=True) * 1
    y = saved.view(1, 3) @ w  # saved through a view: the storage is shared
    free = DeferredFree()
    free.defer(ok)
    free.defer(saved, outputs=y)
    with pytest.raises(UnsafeReleaseError, match=r"deferred at .*test_deferred_free.py:\d+"):
        free.drain()
    assert not is_released(ok) and not is_released(saved) and len(free) == 2
    free.clear()
    assert len(free) == 0


def test_context_manager_drains_on_exit_and_clears_on_error():
    t = _buf(5)
    with DeferredFree() as free:
        free.defer(t, after=FakeWork())
    assert is_released(t) and free.released_bytes == 20
    u = _buf(5)
    with pytest.raises(RuntimeError, match="boom"), DeferredFree() as free2:
        free2.defer(u)
        raise RuntimeError("boom")
    assert not is_released(u) and len(free2) == 0


@pytest.mark.cuda
def test_cuda_event_and_side_stream():
    free = DeferredFree()
    side = torch.cuda.Stream()
    src = torch.randn(1 << 20, device="cuda") * 1
    with torch.cuda.stream(side):
        side.wait_stream(torch.cuda.current_stream())
        dst = src * 2  # the side stream still reads src
        done = torch.cuda.Event()
        done.record(side)
    free.defer(src, after=done)
    free.drain(wait=True)
    assert is_released(src)
    torch.cuda.synchronize()
    assert dst.shape == (1 << 20,)
    t = torch.randn(4096, device="cuda") * 1
    free.defer(t, after=side)  # a stream handle
    assert free.drain(wait=True) == 4096 * 4
