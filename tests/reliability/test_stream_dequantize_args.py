"""stream_dequantize checks every argument before it pops anything: a bad call leaves the caller's dict intact."""

import pytest
import torch

from lightning_memkit.common.validation import ArgumentTypeError
from lightning_memkit.loading import dequantize_mxfp4, stream_dequantize


def _state_dict():
    return {"experts.w_blocks": torch.randint(0, 256, (2, 4, 1, 16), dtype=torch.uint8),
            "experts.w_scales": torch.full((2, 4, 1), 127, dtype=torch.uint8),
            "experts.bias": torch.zeros(2, 4)}


BAD = [
    ({"rows_per_chunk": 0}, ValueError, r"stream_dequantize\(rows_per_chunk=0\): must be an int >= 1 or None"),
    ({"rows_per_chunk": True}, ArgumentTypeError, r"stream_dequantize\(rows_per_chunk=True\): must be an int >= 1 "
                                                  r"or None, got bool"),
    ({"rows_per_chunk": 2.5}, ArgumentTypeError, r"rows_per_chunk=2.5\): must be an int >= 1 or None, got float"),
    ({"device": "meta"}, ValueError, r"device='meta' is not supported; allowed: cpu, cuda"),
    ({"device": "gpu0"}, ValueError, r"device='gpu0' is not a device string"),
]
if not torch.cuda.is_available():
    BAD.append(({"device": "cuda"}, ValueError, r"stream_dequantize\(device='cuda'\): cannot create tensors there"))


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD, ids=[repr(k) for k, _, _ in BAD])
def test_bad_argument_raises_at_the_call_and_keeps_every_entry(kwargs, error, match):
    sd = _state_dict()
    entries = dict(sd)
    with pytest.raises(error, match=match):
        next(stream_dequantize(sd, **kwargs))  # the error comes from the call, before the generator pops
    assert list(sd) == list(entries)
    assert all(sd[k] is entries[k] for k in entries)


def test_non_tensor_entry_is_named_before_anything_is_popped():
    sd = _state_dict()
    sd["experts.scale"] = 0.5
    entries = dict(sd)
    with pytest.raises(TypeError, match=r"state_dict\['experts.scale'\] must be a tensor, got float"):
        next(stream_dequantize(sd, device="cpu"))
    assert list(sd) == list(entries) and all(sd[k] is entries[k] for k in entries)


def test_valid_arguments_still_stream():
    sd = _state_dict()
    want = dequantize_mxfp4(sd["experts.w_blocks"], sd["experts.w_scales"], dtype=torch.float32)
    out = dict(stream_dequantize(sd, dtype=torch.float32, device="cpu", rows_per_chunk=1))
    assert sd == {} and torch.equal(out["experts.w"], want)
