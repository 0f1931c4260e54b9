"""``deepspeed.runtime``: DeepSpeed's runtime module names over dslaunch's ``runtime`` package."""

from deepspeed.runtime import config, engine, lr_schedules, utils, zero

__all__ = ["config", "engine", "lr_schedules", "utils", "zero"]
