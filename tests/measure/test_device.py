import os

import pytest
import torch

from lightning_memkit.memory import active_device_index, device_total_memory, effective_device_memory, resolve_device


def test_cpu_memory_is_physical_memory_or_a_lower_cgroup_limit(monkeypatch):
    from lightning_memkit.measure import device as device_module

    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert device_total_memory("cpu") <= phys
    assert effective_device_memory("cpu") == device_total_memory("cpu")
    assert active_device_index("cpu") is None
    monkeypatch.setattr(device_module, "_physical_memory", lambda: 8 * 2**30)
    monkeypatch.setattr(device_module, "_cgroup_limit", lambda: None)
    assert device_total_memory("cpu") == 8 * 2**30
    monkeypatch.setattr(device_module, "_cgroup_limit", lambda: 2 * 2**30)
    assert device_total_memory("cpu") == 2 * 2**30
    monkeypatch.setattr(device_module, "_physical_memory", lambda: None)
    assert device_total_memory("cpu") == 2 * 2**30


def test_unknown_device_string_names_argument():
    with pytest.raises(ValueError, match=r"device='gpu0'.*allowed: cpu, cuda"):
        resolve_device("gpu0")
    with pytest.raises(ValueError, match="not supported"):
        resolve_device("ipu")
    with pytest.raises(TypeError, match="device must be"):
        resolve_device(3.5)


def test_fraction_and_active_index_mocked(monkeypatch):
    class Props:
        total_memory = 16 * 2**30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 0.5)
    assert resolve_device(None) == torch.device("cuda", 1)
    assert active_device_index() == 1
    assert device_total_memory() == 16 * 2**30
    assert effective_device_memory() == 8 * 2**30
