import sysconfig

import pytest
import torch
import torch.nn.functional as F

from lightning_memkit.demo import ByteTextDataModule, TinyLM
from lightning_memkit.demo.byte_text import FALLBACK_TEXT, load_corpus


def test_shapes_and_layer_names():
    model = TinyLM(d_model=32, n_layers=3, n_heads=4, seq_len=16)
    logits = model(torch.randint(0, 256, (2, 10)))
    assert logits.shape == (2, 10, 256)
    names = {n for n, _ in model.named_modules()}
    assert {"blocks.0", "blocks.1", "blocks.2", "blocks.2.attn", "blocks.2.mlp", "head"} <= names
    assert "blocks.3" not in names


def test_attention_is_causal():
    model = TinyLM(d_model=32, n_layers=2, n_heads=2, seq_len=16).eval()
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 256  # change only the future of position 7
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_loss_decreases_on_real_bytes():
    torch.manual_seed(0)
    dm = ByteTextDataModule(batch_size=8, seq_len=32, max_bytes=100_000, seed=0)
    dm.setup("fit")
    model = TinyLM(d_model=32, n_layers=2, n_heads=2, seq_len=32, lr=1e-2)
    opt = model.configure_optimizers()
    losses = []
    for step, (x, y) in enumerate(dm.train_dataloader()):
        loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 39:
            break
    assert losses[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.1)  # uniform at init
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"loss": "chunked"}, ValueError, r"TinyLM\(loss='chunked'\) is not supported; allowed: 'standard', 'fused'"),
        ({"d_model": 30, "n_heads": 4}, ValueError, r"n_heads=4\) must divide d_model=30"),
        ({"n_layers": 0}, ValueError, r"TinyLM\(n_layers=0\): must be an int >= 1"),
        ({"seq_len": 8.0}, TypeError, "seq_len"),
        ({"lr": -1.0}, ValueError, "lr=-1.0"),
    ],
)
def test_tiny_lm_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        TinyLM(**kwargs)


def test_sequence_longer_than_positions():
    with pytest.raises(ValueError, match="exceeds TinyLM"):
        TinyLM(d_model=32, n_heads=2, seq_len=8)(torch.zeros(1, 9, dtype=torch.long))


def first_batches(dm, n=3):
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(n)]


def test_windows_are_deterministic_and_shifted():
    kwargs = {"batch_size": 4, "seq_len": 16, "max_bytes": 50_000}
    a = first_batches(ByteTextDataModule(seed=3, **kwargs))
    b = first_batches(ByteTextDataModule(seed=3, **kwargs))
    c = first_batches(ByteTextDataModule(seed=4, **kwargs))
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))
    x, y = a[0]
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 256


def test_corpus_is_stdlib_sources_in_sorted_order_and_capped():
    data, source = load_corpus(max_bytes=10_000)
    assert len(data) == 10_000
    assert sysconfig.get_paths()["stdlib"] in source
    again, _ = load_corpus(max_bytes=10_000)
    assert data == again


def test_train_and_val_windows_come_from_disjoint_splits():
    dm = ByteTextDataModule(batch_size=4, seq_len=16, max_bytes=20_000, val_fraction=0.1)
    dm.setup("fit")
    n_train = dm.train_set.data.numel()
    assert n_train + dm.val_set.data.numel() == 20_000
    assert int(dm.train_set.starts.max()) + 17 <= n_train
    x, _ = next(iter(dm.val_dataloader()))
    assert x.shape == (4, 16)


def test_fallback_text_when_stdlib_sources_are_absent(monkeypatch, tmp_path):
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    data, source = load_corpus()
    assert source == str(FALLBACK_TEXT) and data == FALLBACK_TEXT.read_bytes()
    x, y = first_batches(ByteTextDataModule(batch_size=2, seq_len=32), n=1)[0]
    assert x.shape == (2, 32)


def test_own_text_file(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_bytes(bytes(range(256)) * 4)
    dm = ByteTextDataModule(batch_size=2, seq_len=8, path=str(f), val_fraction=0.25)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert torch.equal((x + 1) % 256, y)  # the file counts up byte by byte


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, r"ByteTextDataModule\(batch_size=0\): must be an int >= 1"),
        ({"val_fraction": 1.0}, r"ByteTextDataModule\(val_fraction=1.0\): must be a finite number > 0 and < 1"),
        ({"samples_per_epoch": -3}, "samples_per_epoch=-3"),
        ({"num_workers": -1}, "num_workers=-1"),
    ],
)
def test_datamodule_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ByteTextDataModule(**kwargs)


def test_corpus_too_short_for_seq_len(tmp_path):
    f = tmp_path / "tiny.txt"
    f.write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="too short for seq_len=64"):
        ByteTextDataModule(seq_len=64, path=str(f)).setup("fit")
    with pytest.raises(ValueError, match="neither a file nor a folder"):
        ByteTextDataModule(path=str(tmp_path / "missing")).setup("fit")


def test_fused_loss_matches_standard_loss_and_gradients():
    """Same loss and gradients; above the trunk, the standard loss peaks at two logits tensors, the fused at less
    than one: its gradients plus one auto-sized chunk of fp32 logits."""
    from lightning_memkit.memory import LivePeak
    from lightning_memkit.ops import _cross_entropy_common as common

    batch, seq, d_model = 16, 128, 32
    std = TinyLM(d_model=d_model, n_layers=2, n_heads=2, seq_len=seq)
    fused = TinyLM(d_model=d_model, n_layers=2, n_heads=2, seq_len=seq, loss="fused")
    fused.load_state_dict(std.state_dict())
    x = torch.randint(0, 256, (batch, seq))
    y = torch.randint(0, 256, (batch, seq))
    with LivePeak() as lp:
        hidden = std(x, hidden=True)
    trunk = lp.live_bytes  # what the blocks keep for backward while the head runs
    del hidden
    rows = batch * seq
    logits = rows * 256 * 4
    grads = (256 * d_model + rows * d_model) * 4  # dW of the head and dx, computed in the forward pass
    chunk = max(common.MIN_AUTO_CHUNK_BYTES, grads // 4)  # "auto": fp32 logits rows of >= 1 MiB
    assert chunk < logits
    losses, peaks = [], []
    for model in (std, fused):
        with LivePeak() as lp:
            loss = model._loss((x, y))
        losses.append(loss)
        peaks.append(lp.peak_bytes - trunk)
        loss.backward()
    assert 2 * logits <= peaks[0] <= 2 * logits + 64  # the logits and their log-softmax, both alive
    assert grads + chunk <= peaks[1] <= grads + chunk + 16 * rows * 4 + 4096  # plus per-row vectors
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(std.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
