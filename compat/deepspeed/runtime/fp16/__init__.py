"""``deepspeed.runtime.fp16``: only the 1-bit optimizers' module paths, which raise when built."""
