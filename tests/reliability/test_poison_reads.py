"""Poison mode catches every read of a released storage and is never silently off.

Before: ``.tolist()`` and ``.numpy()`` read the sentinel bytes (NaN) without an error, and a
``MEMKIT_POISON`` value outside the allowed set (``MEMKIT_POISON=ture``) silently meant "off".
"""

import pytest
import torch

from lightning_memkit.memory import PoisonedReadError, poison_guard, release_storage
from lightning_memkit.release.storage_release import poison_enabled


@pytest.mark.parametrize("read", ["tolist", "numpy", "item", "__array__", "sum"])
def test_host_reads_of_a_poisoned_tensor_raise_naming_the_release_site(read):
    x = torch.randn(1, requires_grad=True)
    h = x * 2
    y = h + 1
    release_storage(h, poison=True)
    with poison_guard(), pytest.raises(PoisonedReadError, match=r"released at .*test_poison_reads\.py"):
        getattr(h.detach(), read)()
    y.backward()  # the consumer saved nothing of h: backward is unaffected
    assert torch.equal(x.grad, torch.full((1,), 2.0))


def test_host_reads_of_other_tensors_pass_through():
    h = torch.randn(3) * 2
    release_storage(torch.randn(3) * 1, poison=True)
    with poison_guard():
        assert h.tolist() == h.numpy().tolist() and h[0].item() == h.tolist()[0]


@pytest.mark.parametrize("value, expected", [("1", True), ("ON", True), ("yes", True), ("", False), ("0", False),
                                             ("off", False), ("False", False)])
def test_poison_env_values(monkeypatch, value, expected):
    monkeypatch.setenv("MEMKIT_POISON", value)
    assert poison_enabled() is expected


def test_poison_env_outside_the_allowed_set_is_an_error_listing_them(monkeypatch):
    monkeypatch.setenv("MEMKIT_POISON", "ture")
    with pytest.raises(ValueError, match=r"MEMKIT_POISON='ture' is not allowed; use one of 1, true, yes, on"):
        poison_enabled()
    h = torch.randn(4) * 2
    with pytest.raises(ValueError, match="MEMKIT_POISON"):
        release_storage(h)
    assert h.untyped_storage().nbytes() == 16  # nothing freed
