"""``deepspeed.zero``: the same names as ``deepspeed.runtime.zero``."""

from deepspeed.runtime.zero import (
    GatheredParameters,
    Init,
    partition_parameters,
    register_external_parameter,
    unregister_external_parameter,
)
from runtime.deepspeed_api.unsupported import missing_names

__all__ = [
    "GatheredParameters",
    "Init",
    "partition_parameters",
    "register_external_parameter",
    "unregister_external_parameter",
]


__getattr__ = missing_names(
    "deepspeed.zero",
    "ZeRO-3 offers Init, GatheredParameters and register_external_parameter",
)
