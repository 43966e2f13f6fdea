import functools

import pytest
import torch
import torch.nn.functional as F
from cross_entropy_oracle import OPTION_SETS, NoHostSync, check_against_oracle, make_target

from lightning_memkit.memory import LivePeak
from lightning_memkit.ops import _cross_entropy_common as common
from lightning_memkit.ops import cross_entropy

TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}  # relative to the oracle's largest magnitude


def _compare(dtype, reduction, opts, inplace, shape=(37,), v=301):
    n = int(torch.tensor(shape).prod())
    base = (torch.randn(*shape, v) * 3).to(dtype)
    loss_fn = functools.partial(cross_entropy, inplace_backward=inplace, backend="torch")
    check_against_oracle(loss_fn, base, make_target(n, v, *shape), reduction, opts, TOL[dtype])


@pytest.mark.parametrize("inplace", [False, True], ids=["saved", "inplace"])
@pytest.mark.parametrize("opts", list(OPTION_SETS), ids=list(OPTION_SETS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_fp64_oracle(dtype, reduction, opts, inplace):
    _compare(dtype, reduction, OPTION_SETS[opts], inplace)


def test_3d_logits_and_many_chunks(monkeypatch):
    # 5 rows per chunk: 6 chunks with a ragged last one, on (batch, time, V) logits
    monkeypatch.setitem(common.AUTO_CHUNK_BYTES, "cpu", 5 * 4 * 131)
    _compare(torch.float32, "none", OPTION_SETS["all"], False, shape=(3, 9), v=131)
    _compare(torch.float32, "mean", OPTION_SETS["all"], True, shape=(3, 9), v=131)


def test_all_ignored_mean_is_nan_with_zero_grad():
    logits = torch.randn(4, 9, requires_grad=True)
    target = torch.full((4,), -100)
    loss = cross_entropy(logits * 1, target, label_smoothing=0.1)
    loss.backward()
    ref = F.cross_entropy(logits.detach(), target, label_smoothing=0.1)
    assert torch.isnan(loss) and torch.isnan(ref)
    assert torch.equal(logits.grad, torch.zeros(4, 9))


def test_no_grad_and_custom_ignore_index():
    logits = torch.randn(6, 10)
    target = torch.tensor([0, 3, 7, 7, 9, 1])
    with torch.no_grad():
        ours = cross_entropy(logits, target, ignore_index=7)
    assert torch.allclose(ours, F.cross_entropy(logits, target, ignore_index=7), atol=1e-6)


def test_inplace_backward_allocates_no_logits_sized_tensor():
    n, v = 64, 1000
    w = torch.randn(32, v, requires_grad=True)
    h = torch.randn(n, 32)
    target = make_target(n, v)
    with LivePeak() as ours:
        logits = h @ w
        cross_entropy(logits, target, inplace_backward=True).backward()
        del logits
    w.grad = None
    with LivePeak() as saved:
        logits = h @ w
        cross_entropy(logits, target).backward()
        del logits
    w.grad = None
    with LivePeak() as torch_ce:
        logits = h @ w
        F.cross_entropy(logits, target).backward()
        del logits
    logits_bytes, wgrad_bytes = n * v * 4, 32 * v * 4
    # inplace: the logits (reused as their gradient) + dW + O(N) vectors
    assert ours.peak_bytes <= logits_bytes + wgrad_bytes + 64 * n
    # saved: one more (N, V) buffer for the gradient in backward
    assert ours.peak_bytes + logits_bytes <= saved.peak_bytes <= 2 * logits_bytes + wgrad_bytes + 64 * n
    assert saved.peak_bytes < torch_ce.peak_bytes  # F.cross_entropy also saves an (N, V) log-softmax


def test_inplace_backward_detects_other_readers_of_the_logits():
    w = torch.randn(8, 20, requires_grad=True)
    scale = torch.ones((), requires_grad=True)
    logits = torch.randn(5, 8) @ w
    aux = (logits * scale).sum()  # mul saves `logits` for scale's gradient
    loss = cross_entropy(logits, torch.arange(5), inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + aux).backward()


def test_inplace_backward_refuses_a_second_backward():
    logits = torch.randn(5, 8, requires_grad=True)
    loss = cross_entropy(logits * 1, torch.arange(5), inplace_backward=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="differentiated once"):
        loss.backward()


def test_saved_mode_supports_retain_graph():
    logits = torch.randn(5, 8, requires_grad=True)
    loss = cross_entropy(logits, torch.arange(5), reduction="sum")
    loss.backward(retain_graph=True)
    first = logits.grad.clone()
    loss.backward()
    assert torch.allclose(logits.grad, 2 * first)


def test_runs_inside_torch_compile():
    logits = torch.randn(6, 11, requires_grad=True)
    target = make_target(6, 11)
    compiled = logits.detach().clone().requires_grad_()

    def step(z):
        return cross_entropy(torch.tanh(z) * 4, target, z_loss=1e-2, validate=False) + z.square().mean()

    step(logits).backward()
    torch.compile(step, backend="eager")(compiled).backward()
    assert torch.allclose(logits.grad, compiled.grad, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_host_sync_without_validation(reduction):
    logits = torch.randn(7, 12, requires_grad=True)
    target = make_target(7, 12)
    with NoHostSync():
        loss = cross_entropy(logits, target, reduction=reduction, validate=False, z_loss=1e-3, softcap=5.0)
        loss.sum().backward()
    with pytest.raises(AssertionError, match="host sync"), NoHostSync():
        cross_entropy(logits, target)  # validate=True costs exactly that sync


def test_bad_target_is_a_clear_error_and_nothing_is_modified():
    logits = torch.randn(4, 10)
    before = logits.clone()
    for bad in (10, -1, -101):
        target = torch.tensor([1, bad, 2, -100])
        with pytest.raises(ValueError, match=rf"target holds {bad}, outside \[0, 10\)"):
            cross_entropy(logits, target, inplace_backward=True)
    assert torch.equal(logits, before)


def test_bad_target_without_validation_gives_nan_for_that_token_only():
    logits = torch.randn(4, 10, requires_grad=True)
    target = torch.tensor([1, 12, 2, -100])
    loss = cross_entropy(logits, target, reduction="none", validate=False)
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2, 3]]).all()
    loss[[0, 2]].sum().backward()
    assert torch.isfinite(logits.grad[[0, 2, 3]]).all()


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"label_smoothing": -0.1}, ValueError, r"label_smoothing=-0.1: must be a finite number >= 0 and <= 1"),
        ({"label_smoothing": 1.5}, ValueError, r"label_smoothing=1.5: must be a finite number >= 0 and <= 1"),
        ({"reduction": "avg"}, ValueError, "reduction must be one of"),
        ({"z_loss": -1.0}, ValueError, r"z_loss=-1.0: must be a finite number >= 0"),
        ({"softcap": 0.0}, ValueError, r"softcap=0.0: must be a finite number > 0 or None"),
        ({"ignore_index": 1.0}, TypeError, r"ignore_index=1.0: must be an int, got float"),
        ({"backend": "cuda"}, ValueError, "backend must be one of"),
        ({"inplace_backward": 1}, TypeError, r"inplace_backward=1\): must be a bool, got int"),
    ],
)
def test_bad_options(kwargs, err, match):
    with pytest.raises(err, match=match):
        cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), **kwargs)


def test_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"target shape \(4,\) must equal logits shape"):
        cross_entropy(torch.randn(3, 5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError, match="class probabilities are not supported"):
        cross_entropy(torch.randn(3, 5), torch.rand(3, 5))
    with pytest.raises(TypeError, match="logits must be a floating-point tensor"):
        cross_entropy(torch.ones(3, 5, dtype=torch.long), torch.zeros(3, dtype=torch.long))


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), backend="triton")


@pytest.mark.cuda
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_matches_oracle(dtype, inplace):
    v = 50257  # GPT-2 vocabulary: several kernel blocks, not a power of two
    base = (torch.randn(257, v, device="cuda") * 3).to(dtype)
    target = make_target(257, v).cuda()
    loss_fn = functools.partial(cross_entropy, inplace_backward=inplace)
    check_against_oracle(loss_fn, base, target, "mean", OPTION_SETS["all"], TOL[dtype])
