"""``deepspeed.runtime.engine``: the engine class under DeepSpeed's name."""

from runtime.engine import Engine as DeepSpeedEngine
from runtime.engine import MemoryBreakdown

__all__ = ["DeepSpeedEngine", "MemoryBreakdown"]
