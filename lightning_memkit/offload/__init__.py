"""Activation offload: what backward needs from the repeated blocks goes to host memory as it is produced and comes
back ahead of its use (pure torch)."""
