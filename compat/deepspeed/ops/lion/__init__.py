"""``deepspeed.ops.lion``: not available in dslaunch (the classes raise when built)."""

from runtime.deepspeed_api.unsupported import unsupported_class

_ALTERNATIVE = "use Adam/AdamW (deepspeed.ops.adam, or the config's optimizer section)"
DeepSpeedCPULion = unsupported_class("DeepSpeedCPULion", "Lion optimizer (DeepSpeedCPULion)", _ALTERNATIVE)
FusedLion = unsupported_class("FusedLion", "Lion optimizer (FusedLion)", _ALTERNATIVE)

__all__ = ["DeepSpeedCPULion", "FusedLion"]
