"""Release checks see every holder of a tensor: refused by name, or provably safe (bitwise-equal gradients).

Before the holder count, ``release_storage(h)`` and ``DeferredFree.defer(h)`` + ``drain()`` accepted a
tensor that a ``saved_tensors_hooks`` pack (``save_on_cpu`` on CPU) or a ``ctx`` attribute still held:
backward then read freed storage (wrong gradients or a segfault).
"""

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_memkit.memory import DeferredFree, UnsafeReleaseError, release_storage
from lightning_memkit.release import storage_release
from lightning_memkit.release.storage_release import is_released

REGISTRY: list[torch.Tensor] = []
LAST_ERROR: list[str] = []  # a module-level container: a holder the caller does not own


class KeepOnCtx(torch.autograd.Function):
    """Keeps its input as a ``ctx`` attribute (not through save_for_backward)."""

    @staticmethod
    def forward(ctx, a):
        ctx.a = a
        return a * 3

    @staticmethod
    def backward(ctx, g):
        return g * ctx.a


class ReadRegistry(torch.autograd.Function):
    """Reads the registry's tensor in backward (a container that outlives the call)."""

    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, g):
        return g * REGISTRY[0]


def _hold(pattern, h):
    """Make ``pattern`` hold ``h``; return the consumer outputs (their sum is the loss)."""
    if pattern == "none":
        return [h + 1]
    if pattern == "plain_save":
        return [h.sin()]  # SinBackward0 saves h
    if pattern == "hook_identity":
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return [h.cos()]
    if pattern == "hook_copy":
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            return [h.cos()]
    if pattern == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu():
            return [h.sin()]
    if pattern == "ctx_attr":
        return [KeepOnCtx.apply(h)]
    if pattern == "container":
        REGISTRY.append(h)
        return [ReadRegistry.apply(h)]
    if pattern == "view":
        return [h[1:] * 2]
    if pattern == "checkpoint":
        return [torch.utils.checkpoint.checkpoint(torch.sin, h, use_reentrant=False)]
    raise AssertionError(pattern)


PATTERNS = ["none", "plain_save", "hook_identity", "hook_copy", "save_on_cpu", "ctx_attr", "container", "view",
            "checkpoint"]
SAFE = {"none", "hook_copy"}  # nothing reads h's data later: the release must go through


@pytest.fixture(autouse=True)
def _fast_refusals(request, monkeypatch):
    """The property tests refuse often; naming each holder scans the heap. Refusals do not change."""
    if "bitwise_exact" in request.node.name:
        monkeypatch.setattr(storage_release, "NAME_HOLDERS", False)


def _run(patterns, release, how, seed):
    """Gradient of x, and whether h was released (None: refused)."""
    REGISTRY.clear()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    h = x * 2
    outs = []
    for p in patterns:
        outs += _hold(p, h)
    released = False
    if release:
        try:
            if how == "direct":
                release_storage(h)
            elif how == "outputs":
                release_storage(h, outputs=outs)
            else:
                free = DeferredFree()
                free.defer(h, after=None)
                free.drain()
            released = True
        except UnsafeReleaseError as err:
            released = None
            LAST_ERROR[:] = [str(err)]
    loss = sum(o.sum() for o in outs)
    loss.backward()
    REGISTRY.clear()
    return x.grad, released


HOWS = ["direct", "outputs", "deferred"]
#: every ordered list of one or two patterns (90)
SHORT = [[p] for p in PATTERNS] + [list(pair) for pair in itertools.product(PATTERNS, repeat=2)]


def _check(patterns, how, seed):
    reference, _ = _run(patterns, release=False, how=how, seed=seed)
    grad, released = _run(patterns, release=True, how=how, seed=seed)
    if released:
        assert torch.equal(grad, reference), (patterns, how, seed)
    if set(patterns) <= SAFE:
        assert released is True, f"{patterns}: nothing reads h, the release must go through; refused: {LAST_ERROR}"


@pytest.mark.parametrize("how", HOWS)
def test_every_short_list_is_refused_or_bitwise_exact(how):
    for seed, patterns in enumerate(SHORT):  # all of them, not a sample
        _check(patterns, how, seed)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(
    patterns=st.lists(st.sampled_from(PATTERNS), min_size=3, max_size=3),
    how=st.sampled_from(HOWS),
    seed=st.integers(0, 2**16),
)
def test_release_is_refused_or_bitwise_exact(patterns, how, seed):
    """Three holders at once, sampled (the lists of one and two are all checked above)."""
    _check(patterns, how, seed)


@pytest.mark.slow
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("first", PATTERNS)
def test_every_list_of_three_or_four_is_refused_or_bitwise_exact(first, how):
    longer = itertools.chain(itertools.product(PATTERNS, repeat=2), itertools.product(PATTERNS, repeat=3))
    for seed, rest in enumerate(longer):  # all 9 x 810 lists starting with `first`
        _check([first, *rest], how, seed)


@pytest.mark.parametrize(
    "pattern, holder",
    [
        ("hook_identity", "saved_tensors_hooks pack"),
        ("save_on_cpu", "save_on_cpu"),
        ("ctx_attr", r"KeepOnCtxBackward\.a"),
        ("container", "REGISTRY"),
    ],
)
@pytest.mark.parametrize("how", ["direct", "deferred"])
def test_refusal_names_the_holder(pattern, holder, how):
    x = torch.randn(4, 3, requires_grad=True)
    h = x * 2
    outs = _hold(pattern, h)
    with pytest.raises(UnsafeReleaseError, match=holder):
        if how == "direct":
            release_storage(h)
        else:
            _drain_one(h)
    assert not is_released(h)  # nothing half-applied
    sum(o.sum() for o in outs).backward()
    REGISTRY.clear()


def _drain_one(h):
    free = DeferredFree()
    free.defer(h)
    free.drain()


def test_released_tensor_in_a_local_list_is_the_callers_own():
    """A local list of the calling frame is the caller's own reference, like a local variable."""
    x = torch.randn(4, 3, requires_grad=True)
    h = x * 2
    kept = [h]
    y = h + 1
    assert release_storage(h) == 4 * 3 * 4
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((4, 3), 2.0)) and kept[0] is h


def test_held_by_vouches_for_a_metadata_only_holder():
    x = torch.randn(4, 3, requires_grad=True)
    h = x * 2
    REGISTRY.append(h)  # a schedule keeping stage outputs for a stage-wise backward
    y = h + 1
    with pytest.raises(UnsafeReleaseError, match="REGISTRY"):
        release_storage(h)
    assert release_storage(h, held_by=REGISTRY) == 48
    torch.autograd.backward(y, torch.ones_like(y))
    REGISTRY.clear()
    assert torch.equal(x.grad, torch.full((4, 3), 2.0))
