"""The optimizer state's memory: the step fused into backward (no full gradient buffer), the state and step on the
host, an 8-bit AdamW (pure torch over torch's and bitsandbytes' optimizers)."""

from lightning_memkit.optim.eight_bit import EightBitAdamW, eight_bit, eight_bit_state_bytes
from lightning_memkit.optim.host_offload import HostOffloadOptimizer, host_offload
from lightning_memkit.optim.in_backward import InBackwardOptimizer, in_backward
from lightning_memkit.optim.wrapper import SEPARABLE, StandInOptimizer

__all__ = ["SEPARABLE", "EightBitAdamW", "HostOffloadOptimizer", "InBackwardOptimizer", "StandInOptimizer",
           "eight_bit", "eight_bit_state_bytes", "host_offload", "in_backward"]
