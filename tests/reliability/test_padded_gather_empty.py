"""padded_index_gather with an empty index (or empty rows): forward and backward work, the gradient is all zeros."""

import pytest
import torch

from lightning_memkit.ops import padded_index_gather


@pytest.mark.parametrize("shape", [(5, 3), (5,), (4, 2, 3), (0, 3)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("multiple", [1, 8])
def test_empty_index_forward_and_backward(shape, index_dtype, multiple):
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    y = padded_index_gather(x, torch.empty(0, dtype=index_dtype), multiple)
    assert y.shape == (0, *shape[1:]) and y.dtype == x.dtype and y.untyped_storage().nbytes() == 0
    y.sum().backward()
    assert x.grad.shape == x.shape and x.grad.dtype == x.dtype and torch.count_nonzero(x.grad) == 0


def test_empty_index_backward_with_an_explicit_gradient():
    x = torch.randn(6, 4, requires_grad=True)
    y = padded_index_gather(x, torch.empty(0, dtype=torch.long), 4)
    (grad,) = torch.autograd.grad(y, x, torch.empty(0, 4))
    assert torch.equal(grad, torch.zeros(6, 4))


def test_rows_without_elements_backward():
    x = torch.randn(5, 0, requires_grad=True)
    y = padded_index_gather(x, torch.tensor([4, 1, 4]), 8)
    assert y.shape == (3, 0)
    y.sum().backward()
    assert x.grad.shape == (5, 0)
