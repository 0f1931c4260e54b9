"""``deepspeed.zero``: the same names as ``deepspeed.runtime.zero``."""

from deepspeed.runtime.zero import (
    GatheredParameters,
    Init,
    partition_parameters,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "partition_parameters",
    "register_external_parameter",
    "unregister_external_parameter",
]
