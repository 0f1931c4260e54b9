"""The rest of DeepSpeed's ``partition_parameters`` surface that integrations touch.

Transformers patches ``zero_wrapper_for_fp_tensor_constructor`` around model construction and compares
against ``_orig_torch_arange``; scripts call ``register_external_parameter`` for a weight that one module
uses in another's forward (tied embeddings). Our `runtime.zero.Init` keeps each tensor's dtype and
builds on this rank's device without patching torch's constructors, so the wrapper is a plain function
here (with DeepSpeed's semantics when called) rather than something Init depends on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from runtime.deepspeed_api.unsupported import unsupported
from runtime.zero.gathered import is_sharded
from runtime.zero.hook_control import add_external_parameter, external_parameters, remove_external_parameter
from runtime.zero.stage3_param import ZeroParamStatus

__all__ = [
    "ZeroParamStatus",
    "_orig_torch_arange",
    "external_parameters",
    "register_external_parameter",
    "unregister_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]

_orig_torch_arange = torch.arange
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype, target_device: Any = None
) -> Callable[..., torch.Tensor]:
    """`fn` (a torch tensor constructor) that puts its tensor on `target_device` and gives floating-point
    results `target_fp_dtype`, as DeepSpeed's zero.Init does for tensors built inside it."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if tensor.is_floating_point():
            tensor = tensor.to(target_fp_dtype)
        return tensor

    return wrapped


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that `module`'s forward uses `parameter`, which another module owns.

    Without sharded parameters (ZeRO stages 0-2, or one rank) every weight is whole at all times, so
    nothing has to be gathered and the call only checks its arguments. A ZeRO-3-sharded parameter used
    outside its owner's forward is refused by name.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_external_parameter: module must be a torch.nn.Module, got {type(module)}")
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(
            f"register_external_parameter: parameter must be a torch.nn.Parameter, got {type(parameter)}"
        )
    if is_sharded(parameter):
        unsupported(
            "register_external_parameter for a ZeRO-3-sharded parameter",
            "use the weight only inside the forward of the module that owns it (tie weights by sharing the "
            "module), or gather it explicitly with deepspeed.zero.GatheredParameters around the use",
        )
    add_external_parameter(module, parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo `register_external_parameter`; a parameter never registered is a ValueError."""
    if not remove_external_parameter(module, parameter):
        raise ValueError("unregister_external_parameter: this parameter was not registered on this module")
