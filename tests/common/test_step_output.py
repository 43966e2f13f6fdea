"""training_loss: the loss Lightning takes from a training_step output."""

import torch

from lightning_memkit.common.step_output import training_loss


def test_the_loss_of_a_mapping_a_tensor_and_neither():
    loss = torch.tensor(1.5, requires_grad=True)
    assert training_loss({"loss": loss, "acc": 0.5}) is loss
    assert training_loss(loss) is loss
    assert training_loss({"acc": 0.5}) is None
    assert training_loss(None) is None
