"""HostRSS: the process's peak resident set size in a block, mapped file pages included."""

import mmap
import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_memkit.measure import host_rss as host_rss_module
from lightning_memkit.measure.storage import format_bytes
from lightning_memkit.memory import HostRSS, LivePeak, MemoryReport, current_rss_bytes

MiB = 2**20
BIG = 64 * MiB  # above glibc's largest dynamic mmap threshold (32 MiB): always fresh pages, never reused heap
PAGE = mmap.PAGESIZE

pytestmark = pytest.mark.skipif(current_rss_bytes() is None, reason="no /proc/self/status and no psutil")


def _methods():
    return ["auto", "sampled"] + (["reset"] if _reset_allowed() else [])


def _reset_allowed():
    try:
        with HostRSS(method="reset"):
            return True
    except ValueError:
        return False


@pytest.mark.parametrize("method", _methods())
def test_touched_pages_of_a_mapped_file_count(tmp_path, method):
    path = tmp_path / "blob.bin"
    with open(path, "wb") as f:
        f.truncate(BIG)  # sparse: reading maps zero pages of the page cache, still resident in this process
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        with HostRSS(method=method) as rss, LivePeak() as lp:
            total = sum(mapped[i] for i in range(0, BIG, PAGE))  # one read per page: every page resident
        assert total == 0
    assert rss.method == {"reset": "vmhwm", "sampled": "sampled"}.get(method, rss.method)
    assert rss.increase_bytes >= 0.9 * BIG  # the mapped pages, in RSS ...
    assert lp.peak_bytes == 0  # ... though no tensor was made


@pytest.mark.parametrize("method", _methods())
def test_a_freed_tensor_still_sets_the_peak(method):
    with HostRSS(method=method, interval=0.0005) as rss, LivePeak() as lp:
        x = torch.ones(BIG // 4)  # written: every page resident
        if method != "reset":  # give the sampler time to see it, in case it is no new process peak
            import time

            time.sleep(0.05)
        del x
    assert lp.peak_bytes == BIG and lp.live_bytes == 0
    assert rss.increase_bytes >= 0.9 * BIG
    assert rss.end_bytes < rss.peak_bytes - 0.5 * BIG  # freed (munmap) before the block ended


@pytest.mark.skipif(not _reset_allowed(), reason="/proc/self/clear_refs is not writable here")
def test_nested_trackers_keep_the_outer_peak():
    with HostRSS(method="reset") as outer:  # exact: no sampler to catch the freed tensor
        x = torch.ones(BIG // 4)
        del x
        with HostRSS(method="reset") as inner:  # resets VmHWM: the outer tracker must keep what it saw
            pass
    assert outer.increase_bytes >= 0.9 * BIG
    assert inner.increase_bytes < 0.5 * BIG and inner.method == "vmhwm"


def test_a_new_process_peak_is_read_exactly(tmp_path):
    """No sampling needed when the block sets a new high-water mark: VmHWM is read (checked in a fresh process)."""
    code = ("import torch; from lightning_memkit.memory import HostRSS\n"
            "with HostRSS(interval=60) as rss:\n"  # the sampler never wakes: only VmHWM can see the freed tensor
            "    x = torch.ones(2**25); del x\n"
            "print(rss.method, rss.increase_bytes)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    method, increase = out.stdout.split()
    assert method == "vmhwm" and int(increase) >= 0.9 * 2 * BIG


def test_refused_reset_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setattr(host_rss_module, "_CLEAR_REFS", str(tmp_path / "missing" / "clear_refs"))
    with HostRSS() as rss:  # auto never resets
        pass
    assert rss.method in ("sampled", "vmhwm") and rss.peak_bytes >= rss.start_bytes
    with pytest.raises(ValueError, match=r"HostRSS\(method='reset'\): cannot reset the peak RSS here"):
        with HostRSS(method="reset"):
            pass


def test_unavailable_is_said_not_guessed(monkeypatch, tmp_path):
    monkeypatch.setattr(host_rss_module, "_STATUS", str(tmp_path / "no_status"))
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil -> ImportError
    with HostRSS() as rss, LivePeak() as lp:
        pass
    assert rss.method == "unavailable" and rss.peak_bytes is None and rss.increase_bytes is None
    assert str(MemoryReport.of(lp, rss)).endswith("host RSS unavailable on this platform")


def test_arguments_and_reentry():
    with pytest.raises(ValueError, match=r"HostRSS\(method='max'\): must be one of 'auto', 'reset', 'sampled'"):
        HostRSS(method="max")
    with pytest.raises(ValueError, match=r"HostRSS\(interval=0\): must be a finite number > 0"):
        HostRSS(interval=0)
    rss = HostRSS()
    with rss:
        with pytest.raises(RuntimeError, match="not re-entrant"):
            rss.__enter__()


def test_report_formats_both_numbers():
    report = MemoryReport(tensor_peak_bytes=3 * MiB, rss_start_bytes=100 * MiB, rss_peak_bytes=150 * MiB,
                          rss_end_bytes=120 * MiB, rss_method="vmhwm", tensor_peak_by_device={"cpu": 3 * MiB})
    assert report.rss_increase_bytes == 50 * MiB
    assert str(report) == (f"host RSS peak {format_bytes(150 * MiB)} (+{format_bytes(50 * MiB)} over "
                           f"{format_bytes(100 * MiB)} at start, vmhwm); tensor storage peak "
                           f"{format_bytes(3 * MiB)} ({format_bytes(3 * MiB)} on cpu) (LivePeak)")


LOAD_IN_A_FRESH_PROCESS = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import save_file
    from torch import nn
    from lightning_memkit.loading import load_mxfp4_into

    E, IN, OUT = 4, 2048, 2048
    save_file({"w_blocks": torch.randint(0, 256, (E, OUT, IN // 32, 16), dtype=torch.uint8),
               "w_scales": torch.randint(120, 130, (E, OUT, IN // 32), dtype=torch.uint8),
               "b": torch.randn(E, OUT)}, sys.argv[1])

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(E, IN, OUT, dtype=torch.bfloat16))
            self.b = nn.Parameter(torch.empty(E, OUT))

    with torch.device("meta"):
        model = Experts()
    m = load_mxfp4_into(model, sys.argv[1], device="cpu").memory
    print(m.tensor_peak_bytes, m.rss_start_bytes, m.rss_peak_bytes)
""")


@pytest.mark.slow
def test_load_report_rss_covers_the_tensor_peak_in_a_fresh_process(tmp_path):
    """In a fresh process (no resident free heap to reuse), the RSS rise covers every tensor byte LivePeak saw."""
    out = subprocess.run([sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, str(tmp_path / "w.safetensors")],
                         capture_output=True, text=True, timeout=120, check=True)
    tensor_peak, start, peak = map(int, out.stdout.split())
    final = 4 * 2048 * 2048 * 2 + 4 * 2048 * 4  # the model the load creates
    assert tensor_peak >= final
    assert peak - start >= tensor_peak - 8 * MiB  # a few MiB of heap freed by the imports can be reused
