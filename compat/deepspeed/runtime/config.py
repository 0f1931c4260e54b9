"""``deepspeed.runtime.config``: ``DeepSpeedConfig`` (runtime.deepspeed_api.config_view)."""

from runtime.deepspeed_api.config_view import DeepSpeedConfig

__all__ = ["DeepSpeedConfig"]
