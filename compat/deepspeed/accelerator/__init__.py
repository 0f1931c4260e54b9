"""``deepspeed.accelerator``: the device abstraction (runtime.accelerator)."""

from runtime.accelerator import Accelerator, get_accelerator, set_accelerator
from runtime.unsupported import missing_names

DeepSpeedAccelerator = Accelerator

__all__ = ["DeepSpeedAccelerator", "get_accelerator", "set_accelerator"]


__getattr__ = missing_names(
    "deepspeed.accelerator",
    "get_accelerator() covers cuda and cpu",
)
