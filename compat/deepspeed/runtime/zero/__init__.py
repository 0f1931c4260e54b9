"""``deepspeed.runtime.zero`` (also ``deepspeed.zero``): ZeRO-3's user-facing names."""

from deepspeed.runtime.zero import partition_parameters
from deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
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
    "deepspeed.runtime.zero",
    "ZeRO-3 offers Init, GatheredParameters and register_external_parameter",
)
