"""DeepSpeed's ZeRO-3 parameter-offload object, the one RL libraries reach into, over our stage 3's hooks.

TRL's `unwrap_model_for_generation` (and the RL frameworks that copied it) does this around `generate()`:

    with deepspeed.zero.GatheredParameters(model.parameters()):   # every unit gathered and held
        remove_hooks(model)   # p.ds_active_sub_modules.clear(); forward_hooks/backward_hooks: .remove()
        model.generate(...)   # no gather/release per module and token: the speed of an unsharded model
        add_hooks(model)      # param_coordinator._invalidate_trace(); _register_deepspeed_module(module)

reaching the object through `engine.optimizer.parameter_offload` (DeepSpeed's stage-3 optimizer holds a
`DeepSpeedZeRoOffload` there). `ZeroParamOffload` is that object for our engine; every name maps onto
the `GatherScheduler` (stage3_hooks) that the engine trains with, not onto a second implementation:

    .module                          the engine's model
    .forward_hooks                   the scheduler's module hooks (pre- and post-forward handles): removing
                                     them stops the per-module gather and release
    .backward_hooks                  always empty: our backward gathers are hooks that the post-forward hook
                                     puts on each pass's outputs, so they stop with the forward hooks
    ._register_deepspeed_module(m)   the scheduler's `add_module_hooks` (the older name,
                                     `_register_hooks_recursively`, too)
    .param_coordinator               the recorded forward/backward orders (`_invalidate_trace`)

and `attach_parameter_attributes` gives every parameter `ds_active_sub_modules` (DeepSpeed's set of
running modules using it: ours counts those per unit inside the scheduler, so this set is always empty
and clearing it changes nothing), `ds_status` (AVAILABLE / NOT_AVAILABLE / INFLIGHT, kept by stage3_param
and the units as they gather and release), `ds_id`, `ds_numel` and `ds_shape`, and every module
`ds_external_parameters()` (the parameters declared with `register_external_parameter`). With one rank
stage 3 keeps every weight whole and has no scheduler: the object is there with no hooks, and removing
or re-adding them does nothing.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any

from torch import nn

from runtime.errors import UserError
from runtime.zero.stage3_hooks import GatherScheduler
from runtime.zero.stage3_param import ZeroParamStatus, set_ds_attributes

__all__ = ["ParamCoordinator", "ZeroParamOffload", "attach_parameter_attributes", "external_parameters"]

_EXTERNAL: dict[int, list[nn.Parameter]] = {}  # id(module) -> parameters registered as used by it


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters registered on `module` with register_external_parameter."""
    return list(_EXTERNAL.get(id(module), []))


def add_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    _EXTERNAL.setdefault(id(module), []).append(parameter)


def remove_external_parameter(module: nn.Module, parameter: nn.Parameter) -> bool:
    """Drop one registration; False when `parameter` was not registered on `module`."""
    registered = _EXTERNAL.get(id(module), [])
    if not any(p is parameter for p in registered):
        return False
    _EXTERNAL[id(module)] = [p for p in registered if p is not parameter]
    return True


def _ds_external_parameters(module: nn.Module) -> list[tuple[int, nn.Parameter]]:
    # DeepSpeed's pairs: (key, parameter); callers unpack `for _, param in ...`
    return [(id(p), p) for p in external_parameters(module)]


def attach_parameter_attributes(model: nn.Module) -> None:
    """Give `model`'s parameters and modules the ZeRO-3 attributes RL code reads (module docstring)."""
    for module in model.modules():
        if "ds_external_parameters" not in module.__dict__:
            method = types.MethodType(_ds_external_parameters, module)
            set_ds_attributes(module, ds_external_parameters=method)
    for index, param in enumerate(model.parameters()):
        if not isinstance(getattr(param, "ds_active_sub_modules", None), set):
            set_ds_attributes(param, ds_active_sub_modules=set())
        if not hasattr(param, "ds_status"):  # never released: whole on this rank (frozen, or one rank)
            set_ds_attributes(param, ds_status=ZeroParamStatus.AVAILABLE)
        set_ds_attributes(param, ds_id=index, ds_numel=param.numel(), ds_shape=param.shape)


class ParamCoordinator:
    """DeepSpeed's `PartitionedParameterCoordinator` names for the scheduler's recorded orders."""

    def __init__(self, scheduler: GatherScheduler | None) -> None:
        self._scheduler = scheduler

    def is_invalid_trace(self) -> bool:
        scheduler = self._scheduler
        if scheduler is None:
            return True
        return scheduler.forward_trace.recorded is None

    def _invalidate_trace(self) -> None:
        """Record the unit order again on the next passes (generation may have taken another path)."""
        if self._scheduler is not None:
            self._scheduler.invalidate_traces()

    invalidate_trace = _invalidate_trace


class ZeroParamOffload:
    """`engine.optimizer.parameter_offload` at ZeRO stage 3 (see the module docstring)."""

    def __init__(self, module: nn.Module, scheduler: GatherScheduler | None = None) -> None:
        self.module = module
        self._scheduler = scheduler  # None with one rank
        self._no_hooks: list[Any] = []
        self.backward_hooks: list[Any] = []
        self.param_coordinator = ParamCoordinator(scheduler)
        attach_parameter_attributes(module)

    @property
    def forward_hooks(self) -> list[Any]:
        """The live list of the scheduler's module-hook handles (TRL calls `.remove()` on each)."""
        return self._scheduler.module_hooks if self._scheduler is not None else self._no_hooks

    @forward_hooks.setter
    def forward_hooks(self, handles: Iterable[Any]) -> None:
        # TRL assigns [] after removing each handle; the scheduler keeps whatever is still registered
        if self._scheduler is not None:
            self._scheduler.module_hooks = list(handles)
        else:
            self._no_hooks = list(handles)

    @property
    def hooked(self) -> bool:
        """Whether forward gathers and releases per module now (False between remove and re-add)."""
        return self._scheduler is None or self._scheduler.hooked

    def get_param_coordinator(self, training: bool = True) -> ParamCoordinator:
        return self.param_coordinator

    def _register_deepspeed_module(self, module: nn.Module, count: Any = None) -> None:
        """Hook the model again: every module that uses a unit gathers it before its forward and releases
        it after, as when the engine was built. Idempotent. Takes the engine's model (or one of its
        modules: the hooks are the whole model's either way)."""
        if module is not self.module and not any(m is module for m in self.module.modules()):
            raise UserError(
                f"_register_deepspeed_module got a {type(module).__name__} that is not part of the engine's "
                "model",
                hint="pass engine.optimizer.parameter_offload.module, the model the engine was built on",
            )
        if self._scheduler is not None:
            self._scheduler.add_module_hooks()
        attach_parameter_attributes(self.module)

    _register_hooks_recursively = _register_deepspeed_module  # DeepSpeed before 0.16

    def remove_module_hooks(self) -> None:
        """Our name for what TRL's remove_hooks does through `forward_hooks`."""
        if self._scheduler is not None:
            self._scheduler.remove_module_hooks()
