"""``deepspeed.runtime.config``: ``DeepSpeedConfig`` (runtime.ds_config)."""

from runtime.ds_config import DeepSpeedConfig

__all__ = ["DeepSpeedConfig"]
