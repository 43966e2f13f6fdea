"""The optimizer state's memory: the step fused into backward (no full gradient buffer), the state and step on the
host, an 8-bit AdamW (pure torch over torch's and bitsandbytes' optimizers)."""
