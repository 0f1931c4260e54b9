"""``deepspeed.runtime.fp16.onebit``: DeepSpeed's 1-bit / 0-1 optimizers (not available in dslaunch)."""

from deepspeed.runtime.fp16.onebit.adam import OnebitAdam
from deepspeed.runtime.fp16.onebit.lamb import OnebitLamb
from deepspeed.runtime.fp16.onebit.zoadam import ZeroOneAdam

__all__ = ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"]
