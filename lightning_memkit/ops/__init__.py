"""ops."""

from lightning_memkit.ops import nosave_matmul  # noqa: F401  (module: nosave_linear, dequantize_weight)
from lightning_memkit.ops.cross_entropy import cross_entropy  # noqa: E402,F401
from lightning_memkit.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402,F401
from lightning_memkit.ops.lm_loss import lm_head_loss  # noqa: E402,F401
from lightning_memkit.ops.padded_index_gather import padded_index_gather  # noqa: E402,F401
