import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memkit.ops import lm_head_loss


@pytest.mark.parametrize("bias", [False, True])
def test_fused_and_standard_agree_with_torch(bias):
    head = nn.Linear(16, 97, bias=bias)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    targets = torch.randint(0, 97, (3, 7))
    targets[0, :2] = -100
    losses, grads = [], []
    for fused in (True, False, None):
        head.zero_grad()
        hidden.grad = None
        if fused is None:  # plain PyTorch
            loss = F.cross_entropy(head(hidden).reshape(-1, 97), targets.reshape(-1), label_smoothing=0.1)
        else:
            loss = lm_head_loss(hidden, head, targets, fused=fused, label_smoothing=0.1)
        loss.backward()
        losses.append(loss.detach())
        grads.append([hidden.grad.clone(), head.weight.grad.clone()] + ([head.bias.grad.clone()] if bias else []))
    for loss, g in zip(losses[:2], grads[:2]):
        assert torch.allclose(loss, losses[2], atol=1e-5)
        for a, b in zip(g, grads[2]):
            assert torch.allclose(a, b, atol=1e-6)


def test_options_are_forwarded():
    head = nn.Linear(8, 20, bias=False)
    hidden, targets = torch.randn(5, 8), torch.randint(0, 20, (5,))
    plain = lm_head_loss(hidden, head, targets, reduction="none")
    with_z = lm_head_loss(hidden, head, targets, reduction="none", z_loss=0.1, chunk_size=2)
    lse = torch.logsumexp(head(hidden), -1)
    assert torch.allclose(with_z - plain, 0.1 * lse**2, atol=1e-5)


def test_bad_arguments():
    hidden, targets = torch.randn(5, 8), torch.randint(0, 20, (5,))
    with pytest.raises(TypeError, match="lm_head must be an nn.Linear, got Embedding"):
        lm_head_loss(hidden, nn.Embedding(20, 8), targets)
    with pytest.raises(ValueError, match="chunk_size only apply with fused=True"):
        lm_head_loss(hidden, nn.Linear(8, 20), targets, fused=False, chunk_size=4)
    with pytest.raises(ValueError, match="token_scaling, return_accuracy only apply with fused=True"):
        lm_head_loss(hidden, nn.Linear(8, 20), targets, fused=False, token_scaling=True, return_accuracy=True)
    with pytest.raises(TypeError, match="fused must be a bool"):
        lm_head_loss(hidden, nn.Linear(8, 20), targets, fused="yes")
