"""Argument checks of the ops, loaders and plugin go through lightning_memkit.common.validation: one message format."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lightning_memkit.common.validation import ArgumentTypeError
from lightning_memkit.loading import dequantize_mxfp4, load_mxfp4_into
from lightning_memkit.ops import cross_entropy, padded_index_gather

BLOCKS = torch.zeros(2, 4, 1, 16, dtype=torch.uint8)
SCALES = torch.full((2, 4, 1), 127, dtype=torch.uint8)


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"weight": torch.ones(2, 3)}, path)
    return path


def _ce(**kw):
    return cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), **kw)


def _gather(**kw):
    return padded_index_gather(torch.randn(4, 2), torch.tensor([0, 3]), **kw)


CE = r"cross_entropy\("
GATHER = r"padded_index_gather\("
LOAD = r"load_mxfp4_into\("
CALLS = {
    "ce_inplace": (lambda p: _ce(inplace_backward=1), ArgumentTypeError,
                   CE + r"inplace_backward=1\): must be a bool, got int"),
    "ce_validate": (lambda p: _ce(validate="yes"), ArgumentTypeError,
                    CE + r"validate='yes'\): must be a bool, got str"),
    "gather_bool": (lambda p: _gather(pad_to_multiple=True), ArgumentTypeError,
                    GATHER + r"pad_to_multiple=True\): must be an int >= 1, got bool"),
    "gather_zero": (lambda p: _gather(pad_to_multiple=0), ValueError,
                    GATHER + r"pad_to_multiple=0\): must be an int >= 1"),
    "gather_backend": (lambda p: _gather(backend="cuda"), ValueError,
                       GATHER + r"backend='cuda'\): must be one of 'auto', 'torch', 'triton'"),
    "dequantize_zero": (lambda p: dequantize_mxfp4(BLOCKS, SCALES, rows_per_chunk=0), ValueError,
                        r"rows_per_chunk=0: must be an int >= 1 or None"),
    "dequantize_float": (lambda p: dequantize_mxfp4(BLOCKS, SCALES, rows_per_chunk=2.0), ArgumentTypeError,
                         r"rows_per_chunk=2.0: must be an int >= 1 or None, got float"),
    "load_rows": (lambda p: load_mxfp4_into(nn.Linear(3, 2, bias=False), p, rows_per_chunk=True), ArgumentTypeError,
                  LOAD + r"rows_per_chunk=True\): must be an int >= 1 or None, got bool"),
    "load_strict": (lambda p: load_mxfp4_into(nn.Linear(3, 2, bias=False), p, strict="yes"), ArgumentTypeError,
                    LOAD + r"strict='yes'\): must be a bool, got str"),
    "load_progress": (lambda p: load_mxfp4_into(nn.Linear(3, 2, bias=False), p, progress=1), ArgumentTypeError,
                      LOAD + r"progress=1\): must be a bool, got int"),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_core_arguments(ckpt, case):
    call, error, match = CALLS[case]
    with pytest.raises(error, match=match):
        call(ckpt)


def test_load_with_a_bad_flag_writes_nothing(ckpt):
    model = nn.Linear(3, 2, bias=False)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match="strict"):
        load_mxfp4_into(model, ckpt, strict=None)
    assert torch.equal(model.weight.detach(), before)


def test_callback_arguments(ckpt):
    from lightning_memkit.callbacks.mxfp4_loading import MXFP4CheckpointLoader

    with pytest.raises(ValueError, match=r"MXFP4CheckpointLoader\(rows_per_chunk=0\): must be an int >= 1 or None"):
        MXFP4CheckpointLoader(str(ckpt), rows_per_chunk=0)
    with pytest.raises(ArgumentTypeError, match=r"MXFP4CheckpointLoader\(strict='no'\): must be a bool, got str"):
        MXFP4CheckpointLoader(str(ckpt), strict="no")
    with pytest.raises(ArgumentTypeError, match=r"MXFP4CheckpointLoader\(progress=None\): must be a bool"):
        MXFP4CheckpointLoader(str(ckpt), progress=None)


def test_plugin_mode():
    pytest.importorskip("bitsandbytes")
    from lightning_memkit.plugins import NoSaveBitsandbytesPrecision

    with pytest.raises(ValueError, match=r"NoSaveBitsandbytesPrecision\(mode='nf8'\): must be one of 'nf4', 'nf4-dq', "
                                         r"'fp4', 'fp4-dq', 'int8'"):
        NoSaveBitsandbytesPrecision("nf8")
