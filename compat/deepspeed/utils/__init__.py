"""``deepspeed.utils``: logging, the repeating loader and ZeRO's full-parameter accessors."""

from deepspeed.utils import groups, logging, zero_to_fp32
from runtime.deepspeed_api.params import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    set_z3_leaf_modules,
)
from runtime.deepspeed_api.unsupported import missing_names
from runtime.deepspeed_api.utils import RepeatingLoader, log_dist, logger, print_rank_0

__all__ = [
    "RepeatingLoader",
    "groups",
    "log_dist",
    "logger",
    "logging",
    "print_rank_0",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "set_z3_leaf_modules",
    "zero_to_fp32",
]


__getattr__ = missing_names(
    "deepspeed.utils",
    "see README.md, Coming from DeepSpeed, for what dslaunch supports",
)
