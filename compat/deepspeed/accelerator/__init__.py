"""``deepspeed.accelerator``: the device abstraction (runtime.deepspeed_api.accelerator)."""

from runtime.deepspeed_api.accelerator import Accelerator, get_accelerator, set_accelerator
from runtime.deepspeed_api.unsupported import missing_names

DeepSpeedAccelerator = Accelerator

__all__ = ["DeepSpeedAccelerator", "get_accelerator", "set_accelerator"]


__getattr__ = missing_names(
    "deepspeed.accelerator",
    "get_accelerator() covers cuda and cpu",
)
