import gc
import weakref

import pytest
import ranks
import torch

from lightning_memkit.measure.live_peak import storage_key
from lightning_memkit.memory import LivePeak, empty_device_cache, find_referrers, release_optimizer_state
from lightning_memkit.release.referrers import tensors_with_storages


def _adam(n=1000, steps=2):
    params = [torch.nn.Parameter(torch.randn(n)), torch.nn.Parameter(torch.randn(n, 3))]
    opt = torch.optim.Adam(params, lr=0.1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    return params, opt


def _state_bytes(opt):
    keys = {}
    for st in opt.state.values():
        for t in st.values():
            if isinstance(t, torch.Tensor):
                keys[storage_key(t)] = t.untyped_storage().nbytes()
    return sum(keys.values())


def test_release_optimizer_state_clears_in_place_and_counts_exact_bytes():
    params, opt = _adam()
    expected = _state_bytes(opt)
    assert expected == 2 * 4 * (1000 + 3000) + 2 * 4  # exp_avg, exp_avg_sq per param + two step scalars
    shared_view = opt.state  # another holder of the same dict (as LightningOptimizer keeps)
    assert release_optimizer_state(opt) == expected
    assert len(shared_view) == 0 and shared_view is opt.state


def test_release_counts_only_what_was_freed():
    params, opt = _adam()
    kept = opt.state[params[0]]["exp_avg"]  # somebody still holds one state tensor
    total = _state_bytes(opt)
    assert release_optimizer_state(opt) == total - kept.untyped_storage().nbytes()


def test_optimizer_after_release_steps_like_a_fresh_one():
    params, opt = _adam(steps=3)
    release_optimizer_state(opt)
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = torch.optim.Adam(clones, lr=0.1)
    for p, c in zip(params, clones):
        p.grad = torch.full_like(p, 0.5)
        c.grad = torch.full_like(c, 0.5)
    opt.step()
    fresh.step()
    for p, c in zip(params, clones):
        assert torch.equal(p, c)


def test_release_optimizer_state_rejects_non_optimizers():
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got dict"):
        release_optimizer_state({"state": {}})


def test_empty_device_cache_on_cpu_and_bad_device():
    assert empty_device_cache("cpu") == 0
    with pytest.raises(ValueError, match="device='meta' is not supported; allowed: cpu, cuda, xpu, mps"):
        empty_device_cache("meta")


@pytest.mark.cuda
def test_empty_device_cache_returns_cached_blocks_on_cuda():
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del x
    reserved = torch.cuda.memory_reserved()
    freed = empty_device_cache("cuda")
    assert freed == reserved - torch.cuda.memory_reserved()
    assert freed >= 64 << 20


class Holder:
    pass


def test_find_referrers_names_attribute_path_and_bytes():
    h = Holder()
    h.cache = {"kv": [torch.zeros(1 << 18)]}
    report = find_referrers(h.cache["kv"][0])
    assert [(r.holder, r.path, r.nbytes) for r in report.rows] == [
        (f"{__name__}.Holder", 'Holder.cache["kv"][0]', 1 << 20)
    ]
    assert report.total_bytes == 1 << 20 and report.targets == 1
    assert 'Holder.cache["kv"][0]' in str(report) and "1.00 MiB" in str(report)


def test_find_referrers_does_not_search_objects_frozen_by_gc_freeze():
    """As documented: a holder frozen by ``gc.freeze()`` is missing from the report; unfrozen, it is named. In a fork
    of this test process, whose own freeze (conftest.py) no test may change."""

    def check() -> None:
        h = Holder()
        h.cache = {"kv": [torch.zeros(1 << 18)]}
        gc.freeze()  # h, its dict and its list among the frozen objects
        assert [r.holder for r in find_referrers(h.cache["kv"][0])] == ["(no Python holder)"]
        gc.unfreeze()
        assert [r.path for r in find_referrers(h.cache["kv"][0])] == ['Holder.cache["kv"][0]']

    ranks.in_fork(check)


def test_find_referrers_optimizer_state_and_frame_local():
    params, opt = _adam(n=1 << 16)
    local_ref = opt.state[params[0]]["exp_avg_sq"]
    report = find_referrers([opt.state[params[0]]["exp_avg"], local_ref], min_bytes=0)
    paths = {r.path for r in report}
    assert 'Adam.state[Parameter(65536)]["exp_avg"]' in paths
    assert 'Adam.state[Parameter(65536)]["exp_avg_sq"]' in paths
    frame_rows = [r for r in report if r.holder == "frame"]
    assert [r.path.split(" local ")[-1] for r in frame_rows] == ["'local_ref'"]
    assert report.total_bytes == 2 * (1 << 18)


def test_find_referrers_min_bytes_filters_and_ignore_skips_holders():
    h = Holder()
    h.small, h.big = torch.zeros(10), torch.zeros(1 << 16)
    assert [r.path for r in find_referrers([h.small, h.big], min_bytes=1000)] == ["Holder.big"]
    other = Holder()
    other.big = h.big
    rows = find_referrers(h.big, min_bytes=0, ignore=[h])
    assert [r.path for r in rows] == ["Holder.big"] and len(rows) == 1  # only `other` is left


def test_find_referrers_reports_storage_held_only_by_autograd():
    x = torch.randn(1 << 16, requires_grad=True)
    u = x.exp()
    v = u.sin()  # sin saves its input u for backward
    key = storage_key(u)
    del u
    gc.collect()
    found = tensors_with_storages([key])
    assert len(found) == 1
    report = find_referrers(found, min_bytes=0)
    del found
    assert [r.holder for r in report] == ["(no Python holder)"]
    assert report.rows[0].nbytes == 1 << 18
    v.sum().backward()


def test_find_referrers_of_a_module_object():
    model = torch.nn.Linear(64, 64)
    h = Holder()
    h.model_ref = model
    rows = find_referrers(model)
    assert "Holder.model_ref" in {r.path for r in rows}
    assert rows.rows[0].nbytes == (64 * 64 + 64) * 4


def test_find_referrers_argument_errors():
    with pytest.raises(ValueError, match=r"find_referrers\(min_bytes=-1\): must be an int >= 0"):
        find_referrers(torch.zeros(1), min_bytes=-1)
    with pytest.raises(ValueError, match=r"find_referrers\(max_depth=0\): must be an int >= 1"):
        find_referrers(torch.zeros(1), max_depth=0)


def test_tensors_with_storages_finds_views_of_a_live_storage():
    with LivePeak() as lp:
        base = torch.zeros(100)
    view = base[10:]
    keys = [k for k, *_ in lp.live_storages()]
    found = tensors_with_storages(keys)
    assert any(t is base for t in found) and any(t is view for t in found)
    ref = weakref.ref(base)
    del found
    assert ref() is base


def test_find_referrers_leaves_no_reference_cycle_behind():
    h = Holder()
    h.t = torch.zeros(1 << 16)
    gc.disable()
    try:
        paths = [r.path for r in find_referrers(h.t, min_bytes=0)]
        assert paths == ["Holder.t"]
        ref = weakref.ref(h.t)
        del h.t
        assert ref() is None  # freed by reference counting alone: the walk kept nothing alive
    finally:
        gc.enable()
