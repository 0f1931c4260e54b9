"""``deepspeed.accelerator``: the device abstraction (runtime.accelerator)."""

from runtime.accelerator import Accelerator, get_accelerator, set_accelerator

DeepSpeedAccelerator = Accelerator

__all__ = ["DeepSpeedAccelerator", "get_accelerator", "set_accelerator"]
