"""The device balance probe: measured rates, the per-device cache (process and file), the step time arithmetic."""

from __future__ import annotations

import json

import pytest

from lightning_memkit.measure import machine
from lightning_memkit.measure.machine import H100, MachineBalance, probe_machine, step_seconds


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MEMKIT_MACHINE_CACHE", raising=False)
    monkeypatch.setattr(machine, "_CACHE", {})
    return tmp_path


def test_the_probe_measures_every_rate_and_caches_per_device(cache_dir):
    first = probe_machine("cpu")
    assert first.device.startswith("cpu: ") and set(first.gemm_flops) == {"float32", "bfloat16", "float16"}
    assert all(rate > 1e8 for rate in first.gemm_flops.values())
    assert first.memory_bytes_per_s > 1e8 and first.link_bytes_per_s > 1e8
    assert probe_machine("cpu") is first  # the process's cache
    saved = json.loads((cache_dir / "machine.json").read_text())
    assert saved[first.device]["memory_bytes_per_s"] == first.memory_bytes_per_s
    machine._CACHE.clear()
    assert probe_machine("cpu") == first  # read back from the file, not measured again


def test_the_probe_draws_nothing_from_the_global_random_state(cache_dir):
    import torch

    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    probe_machine("cpu", cache=False)
    assert torch.equal(torch.rand(4), expected)


def test_a_damaged_or_older_cache_is_measured_again(cache_dir, monkeypatch):
    (cache_dir / "machine.json").write_text("{not json")
    measured = probe_machine("cpu")
    entries = json.loads((cache_dir / "machine.json").read_text())
    entries[measured.device]["version"] = 0
    (cache_dir / "machine.json").write_text(json.dumps(entries))
    machine._CACHE.clear()
    calls = []
    real = machine._measure
    monkeypatch.setattr(machine, "_measure", lambda *a: calls.append(a) or real(*a))
    probe_machine("cpu")
    assert len(calls) == 1


def test_no_file_when_the_cache_is_off(cache_dir, monkeypatch):
    monkeypatch.setenv("MEMKIT_MACHINE_CACHE", "0")
    probe_machine("cpu")
    assert not (cache_dir / "machine.json").exists()


def test_step_seconds_prices_flops_traffic_and_the_link():
    m = MachineBalance("d", {"float32": 1e12, "bfloat16": 4e12}, memory_bytes_per_s=1e11, link_bytes_per_s=1e10)
    assert step_seconds(m, 4e12, 0, dtype="bfloat16") == 1.0
    assert step_seconds(m, 0, 5e10) == 1.0  # written once, read once
    assert step_seconds(m, 0, 0, link_bytes=2e10) == 2.0
    assert m.gemm("float8") == 1e12  # not measured: the slowest rate
    assert H100.gemm("bfloat16") / H100.memory_bytes_per_s == pytest.approx(295, rel=0.01)
