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


BALANCE = {"gemm_flops": {"float32": 2e12}, "memory_bytes_per_s": 1e11, "link_bytes_per_s": 1e10}


def test_a_balance_is_read_from_a_preset_a_mapping_json_or_a_file(tmp_path):
    expected = MachineBalance("machine", {"float32": 2e12}, 1e11, 1e10)
    path = tmp_path / "balance.json"
    path.write_text(json.dumps(BALANCE))
    assert machine.machine_balance("h100") is H100 and machine.machine_balance(" H100 ") is H100
    assert machine.machine_balance(expected) is expected
    assert machine.machine_balance(BALANCE) == expected
    assert machine.machine_balance(json.dumps(BALANCE)) == expected
    assert machine.machine_balance(str(path)) == expected
    named = machine.machine_balance({**BALANCE, "device": "my GPU", "host_memory_bytes_per_s": 5e10})
    assert named.device == "my GPU" and named.host_bandwidth == 5e10


@pytest.mark.parametrize(("spec", "message"), [
    ("a100", r"MemoryBudget\(machine=...\) must be a preset \(h100\).*got 'a100' \("),
    ("{gemm", r"got '\{gemm', not JSON"),
    (3, r"must be a preset .*got 3"),
    ({"gemm_flops": {"float32": 1e12}, "memory_bytes_per_s": 1e11}, r"missing link_bytes_per_s"),
    ({**BALANCE, "flops": 1}, r"unknown flops"),
    ({**BALANCE, "memory_bytes_per_s": 0}, r"the bandwidths must be > 0"),
    ({**BALANCE, "gemm_flops": {}}, r"gemm_flops must map dtype names to rates > 0"),
    ({**BALANCE, "gemm_flops": {"float32": True}}, r"gemm_flops must map dtype names to rates > 0"),
])
def test_a_bad_balance_is_refused_naming_the_argument(spec, message):
    with pytest.raises((TypeError, ValueError), match=message):
        machine.machine_balance(spec, "machine", "MemoryBudget")


def test_the_planning_balance_is_the_given_one_then_the_pinned_one_then_the_probe(cache_dir, monkeypatch):
    monkeypatch.delenv("MEMKIT_MACHINE", raising=False)
    probed = []
    monkeypatch.setattr(machine, "_measure", lambda device, key: probed.append(key) or MachineBalance(key, {"f": 1.0}))
    assert machine.planning_balance("cpu").device == probed[0]  # nothing pinned: the probe
    monkeypatch.setenv("MEMKIT_MACHINE", json.dumps(BALANCE))
    pinned = machine.machine_balance(BALANCE, "MEMKIT_MACHINE")
    assert pinned.device == "MEMKIT_MACHINE" and machine.planning_balance("cpu") == pinned
    assert machine.planning_balance("cuda") == pinned  # also for a device not here
    assert machine.planning_balance("cpu", machine="h100") is H100
    monkeypatch.setenv("MEMKIT_MACHINE", "no-such-machine")
    with pytest.raises(ValueError, match=r"^MEMKIT_MACHINE must be a preset"):
        machine.planning_balance("cpu")
    assert len(probed) == 1
