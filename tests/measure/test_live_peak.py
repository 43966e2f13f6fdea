import pytest
import torch

from lightning_memkit.memory import LivePeak


def test_known_allocations_exact():
    with LivePeak() as lp:
        a = torch.empty(1000, dtype=torch.float32)
        b = torch.empty(500, dtype=torch.float64)
        assert lp.live_bytes == 4000 + 4000
        del a
        assert lp.live_bytes == 4000
        c = torch.zeros(10, dtype=torch.uint8)
    assert lp.peak_bytes == 8000
    assert lp.live_bytes == 4010
    del b, c
    assert lp.live_bytes == 0


def test_views_and_inplace_counted_once_and_preexisting_ignored():
    x = torch.randn(256)  # exists before the block: never counted
    with LivePeak() as lp:
        x.mul_(2)
        v = x.view(16, 16)
        y = x + 1  # 1 KiB new
        yv = y[::2]
        y.add_(1)
    assert lp.peak_bytes == 256 * 4
    del y
    assert lp.live_bytes == 256 * 4  # the view keeps the storage alive
    del yv, v
    assert lp.live_bytes == 0


def test_peak_is_high_water_mark_of_temporaries():
    with LivePeak() as lp:
        for _ in range(3):
            t = torch.ones(2048)  # 8 KiB, previous one freed on rebinding
            del t
    assert lp.peak_bytes == 8192
    assert lp.live_bytes == 0


def test_autograd_backward_is_counted():
    w = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(8, 64)
    with LivePeak() as lp:
        y = (x @ w).sum()
        y.backward()
    # w.grad (64*32*4 bytes) is created in the block and stays alive
    assert lp.live_bytes >= w.numel() * 4
    assert lp.is_tracked(w.grad)


def test_per_device_split():
    with LivePeak() as lp:
        a = torch.empty(100, dtype=torch.float32)
        m = torch.empty(100, device="meta")  # meta tensors own no memory
    assert lp.by_device["cpu"].peak == 400
    assert "meta" not in lp.by_device
    del a, m


@pytest.mark.cuda
def test_cuda_split_and_cross_check():
    torch.cuda.init()
    with LivePeak() as lp:
        a = torch.empty(1 << 20, device="cuda")
        b = torch.empty(1000, dtype=torch.float32)
    assert lp.by_device["cuda:0"].peak == 4 << 20
    assert lp.by_device["cpu"].peak == 4000
    assert lp.cuda_peak_delta["cuda:0"] >= 4 << 20
    del a, b


def test_not_reentrant_and_bad_tag():
    lp = LivePeak()
    with lp, pytest.raises(RuntimeError, match="re-entrant"):
        lp.__enter__()
    with pytest.raises(TypeError, match="tag"):
        LivePeak(tag=3)


def test_tag_attribution():
    label = ["a"]
    with LivePeak(tag=lambda: label[0]) as lp:
        x = torch.empty(10)
        label[0] = "b"
        y = torch.empty(20)
    tags = sorted((tag, n) for _, n, _, tag in lp.live_storages())
    assert tags == [("a", 40), ("b", 80)]
    del x, y


def test_out_of_order_exit_keeps_inner_tracker_counting():
    outer, inner = LivePeak(), LivePeak()
    outer.__enter__()
    inner.__enter__()
    a = torch.empty(100)  # both see 400 bytes
    outer.__exit__(None, None, None)  # closed before the tracker opened after it
    b = torch.empty(50)  # only the inner one is still counting
    inner.__exit__(None, None, None)
    assert outer.peak_bytes == 400
    assert inner.peak_bytes == 600
    c = torch.empty(10)  # nobody counts any more
    assert inner.live_bytes == 600
    del a, b, c


def test_host_bytes_are_counted_apart_from_the_device_bytes():
    from lightning_memkit.measure.live_peak import HOST, host_memory, note_host

    with LivePeak() as lp:
        a = torch.empty(1024)  # 4 KiB on the device (here the CPU)
        with host_memory():
            h = torch.empty(512)  # 2 KiB made as host memory
        b = torch.empty(256)  # 1 KiB, moved to the host after it was made
        note_host(b)
        note_host(b)  # once only
        assert (lp.live_bytes, lp.host_live_bytes) == (4096, 3072)
        del a
        assert lp.by_device[HOST].live == 3072 and lp.by_device["cpu"].live == 0
        del h, b
    # the device peak counts b while it was on the device: 4 KiB + 1 KiB
    assert (lp.peak_bytes, lp.host_peak_bytes, lp.live_bytes, lp.host_live_bytes) == (5120, 3072, 0, 0)


def test_host_memory_outside_a_tracker_and_unmeasured_blocks():
    from lightning_memkit.measure.live_peak import host_memory, unmeasured

    with host_memory():
        pass  # no tracker: nothing to do
    with LivePeak() as lp:
        with unmeasured(), host_memory():
            t = torch.empty(1024)
            del t
        assert lp.host_peak_bytes == 0 and lp.peak_bytes == 0
        with unmeasured(), host_memory():
            kept = torch.empty(1024)  # alive after the block: counted from there on
        assert (lp.host_peak_bytes, lp.host_live_bytes, lp.peak_bytes) == (4096, 4096, 0)
        del kept
