"""``deepspeed.ops.adam``: CPU Adam (torch's fused CPU kernel) and fused Adam (runtime.ops.adam)."""

from runtime.ops.adam import CPUAdam as DeepSpeedCPUAdam
from runtime.ops.adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
