"""``deepspeed.checkpoint``: checkpoint helpers."""

from deepspeed.checkpoint import utils

__all__ = ["utils"]
