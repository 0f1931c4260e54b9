"""``deepspeed.runtime``: DeepSpeed's runtime module names over dslaunch's ``runtime`` package."""

from deepspeed.runtime import (
    activation_checkpointing,
    config,
    engine,
    lr_schedules,
    pipe,
    sequence_parallel,
    utils,
    zero,
)
from runtime.deepspeed_api.unsupported import missing_names

__all__ = [
    "activation_checkpointing",
    "config",
    "engine",
    "lr_schedules",
    "pipe",
    "sequence_parallel",
    "utils",
    "zero",
]


__getattr__ = missing_names(
    "deepspeed.runtime",
    "see README.md, Coming from DeepSpeed, for what dslaunch supports",
)
