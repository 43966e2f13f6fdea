import itertools

import pytest
import torch

from lightning_memkit.memory import LivePeak, PoisonedReadError, UnsafeReleaseError, poison_guard, release_storage
from lightning_memkit.release.storage_release import METADATA_ONLY_SAVES, is_released, verify_release


def _act(*shape):
    """An activation: a non-leaf tensor with a grad_fn that saves nothing of it."""
    return torch.randn(*shape, requires_grad=True) * 2


def test_release_frees_exact_bytes_and_keeps_metadata_and_grad_fn():
    a = torch.randn(16, 8, requires_grad=True)
    with LivePeak() as lp:
        h = a * 2  # 512 bytes
        y = (h + 1).sum()  # AddBackward/SumBackward save nothing of h
        before = lp.live_bytes
        assert release_storage(h, outputs=y) == 16 * 8 * 4
        assert lp.live_bytes == before - 512
        assert h.shape == (16, 8) and h.grad_fn is not None and is_released(h)
        assert release_storage(h) == 0  # a second release is a no-op
        y.backward()
    assert torch.equal(a.grad, torch.full_like(a, 2.0))


def test_gradients_bitwise_identical_with_and_without_release():
    def run(release):
        torch.manual_seed(1)
        a = torch.randn(32, 16, requires_grad=True)
        w = torch.randn(16, 4, requires_grad=True)
        h = torch.tanh(a) * 3
        z = torch.zeros(8, 16).index_add(0, torch.arange(32) % 8, h)  # keeps h only for its shape
        if release:
            assert release_storage(h, outputs=z) == 32 * 16 * 4
        ((z @ w) ** 2).sum().backward()
        return a.grad, w.grad

    for got, want in zip(run(True), run(False)):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: torch.nn.Parameter(torch.randn(4)), "is a parameter"),
        (lambda: torch.randn(4, requires_grad=True), "leaf that requires grad"),
        (lambda: _act(4, 6).t(), "non-contiguous view"),
        (lambda: _act(4, 6)[:2], "is a view"),
        (lambda: torch.randn(4, 4).to_sparse(), "strided tensor"),
    ],
)
def test_bad_inputs_raise_whatever_check(make, match):
    t = make()
    for check in (True, False):
        with pytest.raises(ValueError, match=match):
            release_storage(t, check=check)


def test_type_errors():
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        release_storage([1, 2])
    with pytest.raises(TypeError, match=r"check=\.\.\.\) must be a bool"):
        release_storage(_act(3), check="yes")


def test_refuses_tensor_a_later_op_reads_and_names_the_node():
    w = torch.randn(8, 3, requires_grad=True)
    h = _act(5, 8)
    y = h @ w  # MmBackward0 saves h
    with pytest.raises(UnsafeReleaseError, match=r"saved for backward by MmBackward0 \(self\)"):
        release_storage(h, outputs=y)
    with pytest.raises(UnsafeReleaseError, match="pass outputs="):
        release_storage(h)
    assert not is_released(h)  # nothing half-applied
    e = h.exp()  # ExpBackward0 saves its own result
    with pytest.raises(UnsafeReleaseError, match=r"ExpBackward0 \(result\)"):
        release_storage(e)


@pytest.mark.parametrize("alias", ["view", "detach", "storage_set"])
def test_refuses_shared_storage(alias):
    h = _act(6, 4)
    other = {
        "view": lambda: h.view(-1),
        "detach": lambda: h.detach(),
        "storage_set": lambda: torch.empty(0).set_(h.untyped_storage()),
    }[alias]()
    with pytest.raises(UnsafeReleaseError, match="shared by"):
        release_storage(h)
    del other
    assert release_storage(h) == 96


def test_refuses_identity_exchange_output():
    h = _act(6, 4)
    expert_in = h  # an exchange that returned its input (expert parallelism off)
    with pytest.raises(UnsafeReleaseError, match="returned its input"):
        release_storage(h, outputs=expert_in)


def test_refuses_custom_function_ctx_attribute_and_hooked_saves():
    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.kept = x
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * ctx.kept

    h = _act(4)
    out = Keep.apply(h)
    with pytest.raises(UnsafeReleaseError, match=r"KeepBackward \(ctx.kept\)"):
        release_storage(h, outputs=out)

    # a pack hook that keeps the tensor itself is refused; one that keeps a copy holds nothing of h2
    w = torch.randn(4, 2, requires_grad=True)
    h2 = _act(3, 4)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        out2 = h2 @ w
    with pytest.raises(UnsafeReleaseError, match=r"saved for backward by MmBackward0 \(self\)"):
        release_storage(h2, outputs=out2)
    with pytest.raises(UnsafeReleaseError, match="saved_tensors_hooks pack"):
        release_storage(h2)
    want = torch.autograd.grad(out2.sum(), w)[0]  # backward frees what the identity pack kept
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        out3 = h2 @ w
    assert release_storage(h2, outputs=out3) == 3 * 4 * 4
    assert torch.equal(torch.autograd.grad(out3.sum(), w)[0], want)


def test_metadata_only_allowlist_is_really_metadata_only():
    # IndexAddBackward0 keeps `source` but reads only its shape: release it for real, then backward.
    assert ("IndexAddBackward0", "source") in METADATA_ONLY_SAVES
    a = torch.randn(10, 3, requires_grad=True)
    src = a * 3
    idx = torch.tensor([0, 1, 1, 2, 0, 3, 3, 3, 2, 1])
    out = torch.zeros(4, 3).index_add(0, idx, src)
    assert verify_release(src, out) == []
    release_storage(src, outputs=out)
    (out * torch.arange(12.0).view(4, 3)).sum().backward()
    assert torch.equal(a.grad, 3 * torch.arange(12.0).view(4, 3)[idx])


def test_poison_fills_sentinel_and_catches_forward_read_with_site():
    h = _act(4, 3)
    alias = h  # a Python alias: invisible to the check, caught by poisoning
    with poison_guard():
        release_storage(h, poison=True)
        with pytest.raises(PoisonedReadError, match=r"test_storage_release.py:\d+ in test_poison"):
            alias.sum()
    i = torch.arange(6, dtype=torch.int32) * 1
    release_storage(i, poison=True)
    assert i.tolist() == [-1] * 6  # read outside the guard: the fixed pattern
    f = _act(5)
    release_storage(f, poison=True)
    assert torch.isnan(f.detach()).all()


def test_poison_catches_backward_read(monkeypatch):
    monkeypatch.setenv("MEMKIT_POISON", "1")
    w = torch.randn(3, 2, requires_grad=True)
    h = _act(4, 3)
    y = (h @ w).sum()
    with poison_guard():
        release_storage(h, check=False)  # the user vouched; poison mode proves them wrong
        with pytest.raises(PoisonedReadError, match="aten.mm"):
            y.backward()


# -- property: a release never silently corrupts a value read later ----------------------------------------
ALIASES = ["none", "view", "detach", "identity", "clone"]
CONSUMERS = ["add", "mm", "exp", "index_add", "mul_leaf"]
READS = ["none", "forward", "backward", "both"]


def _scenario(alias, consumer, read, mode):
    """Build the pattern; mode None: no release; otherwise poison/real release. Returns final values."""
    torch.manual_seed(0)
    a = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(4, 5, requires_grad=True)
    h = a * 2  # the boundary tensor
    src = {"none": h, "view": h.view(4, 6).view(6, 4), "detach": h.detach(), "identity": h, "clone": h.clone()}[alias]
    kept = src if alias != "none" else None  # what a later stage keeps
    y = {
        "add": lambda: src + 1,
        "mm": lambda: src @ w,
        "exp": lambda: src.exp(),
        "index_add": lambda: torch.zeros(3, 4).index_add(0, torch.tensor([0, 1, 2, 0, 1, 2]), src),
        "mul_leaf": lambda: src * w[:, 0],
    }[consumer]()
    h_sum = h.sum()  # read before the release: keeps `a` in the graph whatever the consumer
    if mode is not None:
        release_storage(h, outputs=y, poison=(mode == "poison"))
    values = []
    if read in ("forward", "both") and kept is not None:
        values.append((kept * 3).detach())
    if read in ("backward", "both"):
        loss = h_sum + (y * torch.linspace(0.5, 1.5, y.numel()).view_as(y)).sum() if y.requires_grad else h_sum
        loss.backward()
        values += [a.grad, w.grad if w.grad is not None else torch.zeros(())]
    values.append(y.detach())
    return values


SCENARIOS = list(itertools.product(ALIASES, CONSUMERS, READS))


def _poisoned(alias, consumer, read):
    """The scenario with a poisoned release: its values, or how it ended (``"refused"`` or ``"caught"``)."""
    try:
        with poison_guard():
            return _scenario(alias, consumer, read, "poison")
    except UnsafeReleaseError:
        return "refused"
    except PoisonedReadError:
        return "caught"


@pytest.fixture(scope="module")
def poisoned():
    """Every scenario (all 100) run once with a poisoned release, for the tests below."""
    return {scenario: _poisoned(*scenario) for scenario in SCENARIOS}


@pytest.mark.parametrize("alias", ALIASES)
def test_property_release_is_refused_caught_or_harmless(alias, poisoned):
    for consumer, read in itertools.product(CONSUMERS, READS):
        got, case = poisoned[alias, consumer, read], (alias, consumer, read)
        # what torch can see: another tensor on the storage, or a node that saved h and reads it
        visible = alias in ("view", "detach") or (alias in ("none", "identity") and consumer in ("mm", "mul_leaf"))
        if got == "refused":  # nothing was released
            assert visible, f"refused although nothing visible to torch reads the storage: {case}"
            continue
        if got == "caught":  # a later read (through a plain Python alias) was caught, naming the release site
            assert not visible, f"a reader torch could see was not refused: {case}"
            continue
        assert not visible, case
        # accepted and nothing read the storage: every value equals the reference, bit for bit
        reference = _scenario(alias, consumer, read, None)
        assert all(torch.equal(p, r) for p, r in zip(got, reference)), case
        # and the real release (storage freed) gives the same values
        real = _scenario(alias, consumer, read, "real")
        assert all(torch.equal(p, r) for p, r in zip(real, reference)), case


def test_property_scenarios_exercise_every_outcome(poisoned):
    """The property above is not vacuous: each outcome occurs in the scenario space."""
    outcomes = {got if isinstance(got, str) else "accepted" for got in poisoned.values()}
    assert outcomes == {"accepted", "refused", "caught"}
