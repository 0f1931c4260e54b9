"""Mixed precision: which dtype does what, and the inputs cast to it.

Working weights (forward/backward) are in `param_dtype` (bf16, fp16 or fp32); gradients are produced,
reduced and accumulated in that dtype too (the ZeRO paper's 2 bytes/parameter); the optimizer steps fp32
master weights, or bf16 ones with `bf16.bf16_master_weights_and_grads` (their moments in `state_dtype`,
the update in master_adam.py). With `torch_autocast` the weights stay fp32 and the forward runs under
`torch.autocast(autocast_dtype)`. The arithmetic between the reduced gradients and the optimizer step
(average, unscale, norm, clip) is grad_math.py's.

`input_dtype_error` turns the model's failure on inputs of another dtype into an `InputDtypeError` that
says which key or cast fixes it.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any

import torch

from runtime.config import Config
from runtime.precision.errors import InputDtypeError
from runtime.precision.loss_scaler import DynamicLossScaler, LossScaler, StaticLossScaler

_DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes of one run (FSDP2's MixedPrecisionPolicy in DeepSpeed's vocabulary)."""

    param_dtype: torch.dtype = torch.float32  # working weights, activations, gradients
    master_dtype: torch.dtype = torch.float32  # weights the optimizer updates, and its state
    reduce_dtype: torch.dtype = torch.float32  # gradients on the wire
    cast_inputs: bool = False  # cast floating-point forward inputs to param_dtype
    # the optimizer's moments (bf16.bf16_optimizer_states); masters in bf16 keep fp32 moments without it
    state_dtype: torch.dtype = torch.float32
    stochastic_rounding: bool = False  # bf16 masters rounded stochastically in the update (master_adam.py)
    autocast_dtype: torch.dtype | None = None  # torch_autocast: the forward runs under torch.autocast
    # torch_autocast.lower_precision_safe_modules: their own parameters' gradients go on the wire in
    # autocast_dtype (autocast_reduced_params)
    autocast_safe_modules: tuple[type, ...] = ()

    @property
    def uses_loss_scaling(self) -> bool:
        return self.param_dtype == torch.float16


def policy_from_config(config: Config) -> PrecisionPolicy:
    """The policy a runtime `Config` asks for.

    Floating-point inputs are cast to bf16 for bf16 runs (a bf16 model cannot take fp32 activations), and
    to fp16 only when fp16.auto_cast is set (DeepSpeed's behaviour).
    """
    param_dtype = config.param_dtype
    reduce_dtype = (
        _DTYPE_NAMES[config.communication_data_type] if config.communication_data_type else param_dtype
    )
    cast = param_dtype == torch.bfloat16 or (param_dtype == torch.float16 and config.fp16.auto_cast)
    bf16 = config.bf16
    masters = torch.bfloat16 if bf16.enabled and bf16.bf16_master_weights_and_grads else torch.float32
    autocast = config.torch_autocast
    # a name that does not import is refused here, before anything is built
    safe = safe_module_types(autocast.lower_precision_safe_modules) if autocast.enabled else ()
    return PrecisionPolicy(
        param_dtype=param_dtype,
        master_dtype=masters,
        reduce_dtype=reduce_dtype,
        cast_inputs=cast,
        state_dtype=torch.bfloat16 if bf16.enabled and bf16.bf16_optimizer_states else torch.float32,
        stochastic_rounding=masters == torch.bfloat16 and bf16.stochastic_rounding,
        autocast_dtype=getattr(torch, autocast.dtype) if autocast.enabled else None,
        autocast_safe_modules=safe,
    )


def autocast_reduced_params(model: torch.nn.Module, policy: PrecisionPolicy) -> set[torch.nn.Parameter]:
    """The trainable parameters whose gradients are reduced in the autocast dtype, DeepSpeed's meaning of
    `torch_autocast.lower_precision_safe_modules`: the own parameters (not their children's) of modules
    whose class is exactly one of those named (a subclass is not: its extra code may not be safe). Empty
    where the run reduces in that dtype anyway (bf16 weights beside autocast)."""
    dtype = policy.autocast_dtype
    if dtype is None or dtype == policy.reduce_dtype or not policy.autocast_safe_modules:
        return set()
    return {
        p
        for module in model.modules()
        if type(module) in policy.autocast_safe_modules
        for p in module.parameters(recurse=False)
        if p.requires_grad
    }


def autocast_context(policy: PrecisionPolicy, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """torch.autocast in the policy's dtype for the forward (torch_autocast), else nothing."""
    if policy.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=policy.autocast_dtype)


def safe_module_types(names: tuple[str, ...]) -> tuple[type, ...]:
    """The classes `torch_autocast.lower_precision_safe_modules` names, each an nn.Module subclass."""
    from runtime.config import ConfigError

    key = "torch_autocast.lower_precision_safe_modules"
    found = []
    for name in names:
        module_name, _, attr = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr) if module_name else None
        except (ImportError, AttributeError):
            cls = None
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise ConfigError(
                key,
                f"{name!r} is not an importable torch.nn.Module class",
                hint='name module classes with their import path, like "torch.nn.Linear"',
            )
        found.append(cls)
    return tuple(found)


def scaler_from_config(config: Config) -> LossScaler | None:
    """The fp16 loss scaler (static when fp16.loss_scale > 0), or None without fp16."""
    fp16 = config.fp16
    if not fp16.enabled:
        return None
    if fp16.loss_scale > 0:
        return StaticLossScaler(fp16.loss_scale)
    return DynamicLossScaler(
        initial_scale_power=fp16.initial_scale_power,
        window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        min_scale=fp16.min_loss_scale,
    )


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """`value` with every floating-point tensor inside (tuples, lists, dicts) cast to `dtype`."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(cast_floating(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value


_DTYPE_WORDS = ("dtype", "scalar type", "type (", "Half", "BFloat16", "Float", "Double")
_KEY_OF = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def input_dtype_error(error: RuntimeError, inputs: Any, param_dtype: torch.dtype) -> InputDtypeError | None:
    """The error to raise instead of `error` (raised by the model's forward on `inputs`) when it is a
    dtype mismatch between the inputs and the `param_dtype` weights; None when it is something else."""
    first_line = str(error).strip().split("\n", 1)[0]
    if not any(word in first_line for word in _DTYPE_WORDS):
        return None
    other = _foreign_floating(inputs, param_dtype)
    if other is None:
        return None
    where, tensor = other
    weights = _KEY_OF.get(param_dtype, str(param_dtype))
    message = (
        f"engine forward: the model's weights are {weights} but {where} is a "
        f"{str(tensor.dtype).removeprefix('torch.')} tensor of shape {tuple(tensor.shape)}, and the model "
        f"failed on the mismatch: {first_line}"
    )
    if param_dtype == torch.float16:
        hint = (
            'set "fp16": {"enabled": true, "auto_cast": true} so the engine casts floating-point inputs '
            "to fp16, or cast them yourself (x.half())"
        )
    elif param_dtype == torch.bfloat16:
        hint = (
            "the engine casts floating-point tensors in tuples, lists and dicts to bf16; cast tensors "
            "held in other containers yourself (x.bfloat16())"
        )
    else:
        hint = 'cast the inputs to float32 (x.float()), or enable "bf16" or "fp16" to train in their dtype'
    return InputDtypeError(message, hint=hint)


def _foreign_floating(value: Any, dtype: torch.dtype, where: str = "") -> tuple[str, torch.Tensor] | None:
    """The first floating-point tensor in `value` (an (args, kwargs) pair at the top) not in `dtype`."""
    if isinstance(value, torch.Tensor):
        return (where, value) if value.is_floating_point() and value.dtype != dtype else None
    if isinstance(value, dict):
        items = [(f"{where}[{k!r}]" if where else f"keyword argument {k!r}", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        if not where:  # the top level: (args, kwargs)
            args, kwargs = value
            items = [(f"argument {i}", v) for i, v in enumerate(args)] + [("", kwargs)]
        else:
            items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    else:
        return None
    for at, item in items:
        found = _foreign_floating(item, dtype, at)
        if found is not None:
            return found
    return None


def cast_unmanaged(model: torch.nn.Module, managed: set[torch.nn.Parameter], dtype: torch.dtype) -> None:
    """Frozen parameters and floating-point buffers follow the working dtype (like module.to(dtype))."""
    with torch.no_grad():
        for param in model.parameters():
            if param not in managed and param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                    module._buffers[key] = buf.to(dtype)
