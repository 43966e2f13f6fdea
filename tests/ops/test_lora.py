import math

import pytest
import torch

from lightning_memkit.memory import LivePeak
from lightning_memkit.ops.lora import LoRAAdapter, check_lora_args


def test_init_scaling_and_reference():
    lora = LoRAAdapter(32, 24, rank=4, alpha=8)
    assert lora.A.shape == (4, 32) and lora.B.shape == (24, 4) and lora.A.dtype == torch.float32
    assert torch.count_nonzero(lora.B) == 0 and lora.scaling == 2.0
    assert lora.A.abs().max() <= 1 / math.sqrt(32)  # kaiming_uniform(a=sqrt(5)) bound: 1/sqrt(fan_in)
    torch.nn.init.normal_(lora.B)
    x = torch.randn(5, 32, dtype=torch.float64)
    expected = x @ lora.A.double().t() @ lora.B.double().t() * 2.0
    torch.testing.assert_close(lora(x.float()).double(), expected, rtol=1e-5, atol=1e-5)


def test_computes_in_the_input_dtype_and_trains_float32_params():
    lora = LoRAAdapter(16, 8, rank=2)
    torch.nn.init.normal_(lora.B)
    x = torch.randn(3, 16, dtype=torch.bfloat16, requires_grad=True)
    out = lora(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert lora.A.grad.dtype == lora.B.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def test_dropout_only_in_training():
    lora = LoRAAdapter(16, 8, rank=2, dropout=0.5)
    torch.nn.init.normal_(lora.B)
    x = torch.randn(64, 16)
    lora.eval()
    torch.testing.assert_close(lora(x), lora(x))
    lora.train()
    assert not torch.equal(lora(x), lora(x))


def test_retains_its_input_and_the_rank_intermediate_only():
    lora = LoRAAdapter(64, 32, rank=4)
    base = torch.randn(10, 64, requires_grad=True)
    with LivePeak() as lp:
        x = base * 1.0
        out = lora(x)
        del x
        retained = lp.live_bytes - out.untyped_storage().nbytes()
    assert retained == 10 * 64 * 4 + 10 * 4 * 4


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [((-1, 16, 0.0), ValueError, r"LoRAAdapter\(lora_rank=-1\): must be an int >= 0"),
     ((True, 16, 0.0), TypeError, r"LoRAAdapter\(lora_rank=True\): must be an int >= 0, got bool"),
     ((4, float("inf"), 0.0), ValueError, r"LoRAAdapter\(lora_alpha=inf\): must be a finite number > 0"),
     ((4, 16, -0.1), ValueError, r"LoRAAdapter\(lora_dropout=-0.1\): must be a finite number >= 0 and < 1")],
)
def test_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        check_lora_args(*args)
    with pytest.raises(ValueError, match=r"LoRAAdapter\(lora_rank=0\): must be an int >= 1"):
        LoRAAdapter(4, 4, rank=0)
