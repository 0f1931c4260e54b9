"""``deepspeed.runtime.utils``: memory reporting and the gradient-norm helpers scripts import."""

from runtime.memory import see_memory_usage

__all__ = ["see_memory_usage"]
