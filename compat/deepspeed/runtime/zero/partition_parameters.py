"""``deepspeed.runtime.zero.partition_parameters``: zero.Init, GatheredParameters and the hooks
integrations patch (Transformers swaps ``zero_wrapper_for_fp_tensor_constructor`` while it builds
RoPE buffers). Behaviour: runtime.zero and runtime.deepspeed_api.zero_params."""

from runtime.deepspeed_api.accelerator import get_accelerator
from runtime.deepspeed_api.zero_params import (
    ZeroParamStatus,
    _orig_torch_arange,
    register_external_parameter,
    unregister_external_parameter,
    zero_wrapper_for_fp_tensor_constructor,
)
from runtime.zero import GatheredParameters, Init

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "_orig_torch_arange",
    "get_accelerator",
    "register_external_parameter",
    "unregister_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]
