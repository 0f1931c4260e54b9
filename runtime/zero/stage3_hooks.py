"""ZeRO-3 gathering around module calls: forward/backward hooks, prefetch, and the training state.

`GatherScheduler` registers two hooks on every module that uses a unit (the unit's root module, and the
modules that share its tied parameters) and decides when each unit is gathered and released:

- `_pre_forward`: gather the module's units (waiting for prefetches in flight), then prefetch what the
  forward trace says comes next, within stage3_prefetch_bucket_size and stage3_max_live_parameters;
- `_post_forward`: release units no running module needs any more, unless the trace says they are needed
  again within stage3_max_reuse_distance elements; hook the outputs so backward gathers them again;
- `_pre_backward` (a hook on the module's outputs, so it runs before the module's backward): gather
  again and prefetch along the backward trace. Release in backward happens when the unit's gradients
  are complete (the stage calls `release_after_backward` from its gradient hooks);
- end of a pass: release whatever was prefetched or kept and not used.

A parameter used outside the forward of a module that gathers it (a child's weight read in the parent's
forward) is gathered on first touch (stage3_param's guard calls `touch`) and from then on counts as
used by the module that was running, so later passes gather it with that module and backward finds it.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from runtime.zero import stage3_param
from runtime.zero.stage3_trace import ExecutionTrace, prefetch_candidates, reuse_distance
from runtime.zero.stage3_unit import GatherStats, ShardedUnit, UnitState

_log = logging.getLogger("runtime.zero.stage3")

OUTSIDE_ENGINE_BACKWARD = (
    "ZeRO stage 3 gathers weights and reduces gradients inside engine.backward(loss); a backward pass "
    "started elsewhere (loss.backward(), torch.autograd.grad) reached the model's parameters: call "
    "engine.backward(loss) instead"
)


class TrainingState(enum.Enum):
    IDLE = "idle"  # no pass running
    FORWARD = "forward"  # inside the forward of a hooked module
    BACKWARD = "backward"  # between begin_backward and end_backward (recomputation runs forwards here)


@dataclass(frozen=True)
class GatherPolicy:
    """How far ahead to gather and how much to keep (elements, DeepSpeed's stage3_* settings)."""

    prefetch_numel: int = 50_000_000  # stage3_prefetch_bucket_size; 0 disables prefetching
    max_live_numel: int = 1_000_000_000  # stage3_max_live_parameters
    max_reuse_distance: int = 1_000_000_000  # stage3_max_reuse_distance; 0 releases after every use


class GatherScheduler:
    """Decides when each unit is gathered and released (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        units: Sequence[ShardedUnit],
        policy: GatherPolicy,
        names: dict[nn.Parameter, str],
        stats: GatherStats,
    ) -> None:
        self.model = model
        self.units = list(units)
        self.policy = policy
        self.stats = stats
        self.state = TrainingState.IDLE
        self.forward_trace = ExecutionTrace()
        self.backward_trace = ExecutionTrace()
        self._names = names
        self._unit_of = {p: unit for unit in self.units for p in unit.params}
        modules = dict(model.named_modules(remove_duplicate=False))
        self._users: dict[nn.Module, list[int]] = {model: []}
        for unit in self.units:
            for name in unit.plan.users:
                self._users.setdefault(modules[name], []).append(unit.index)
        self._active = [0] * len(self.units)  # running modules (and GatheredParameters) using a unit
        self._stack: list[nn.Module] = []
        self._tracing = False  # the current forward started at the model, so the trace applies
        self._prefetched: set[int] = set()
        self.module_hooks: list[RemovableHandle] = []
        self.handed_over = False  # another engine took the model over (hand_over)
        # the stage whose units these are, told at hand_over (it removes its gradient hooks)
        self.on_hand_over: Callable[[int], None] | None = None
        self.add_module_hooks()
        for param in self._unit_of:
            stage3_param.register(param, self)

    # -- the module hooks (TRL removes them around generate(); runtime.zero.hook_control) -----------
    def add_module_hooks(self) -> None:
        """(Re-)register the pre- and post-forward hooks on every module that uses a unit. Hooks still
        registered are removed first, so calling this twice never gathers twice. Not after `hand_over`:
        the model's hooks are the other engine's then."""
        self.remove_module_hooks()
        if self.handed_over:
            return
        for module in self._users:
            self.module_hooks.append(module.register_forward_pre_hook(self._pre_forward))
            self.module_hooks.append(module.register_forward_hook(self._post_forward, always_call=True))

    def remove_module_hooks(self) -> None:
        """Stop gathering and releasing around module calls. Until `add_module_hooks`, a forward reads
        whatever is gathered now (GatheredParameters) and a released parameter raises ParamNotGathered."""
        for handle in self.module_hooks:
            handle.remove()
        self.module_hooks.clear()

    @property
    def hooked(self) -> bool:
        return bool(self.module_hooks)

    def invalidate_traces(self) -> None:
        """Forget the recorded forward and backward orders; the next passes record them again (until
        then nothing is prefetched). Only between passes."""
        if self.state is not TrainingState.IDLE:
            raise RuntimeError(
                "ZeRO-3 traces can only be reset between passes, not during a forward or backward"
            )
        self.forward_trace = ExecutionTrace()
        self.backward_trace = ExecutionTrace()

    # -- forward ----------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if not self._stack and self.state is TrainingState.IDLE:
            self.state = TrainingState.FORWARD
            self._tracing = module is self.model
            if self._tracing:
                self.forward_trace.begin()
        self._stack.append(module)
        needed = self._users[module]
        for index in needed:
            self._need(index, self.forward_trace)
        for index in needed:
            self._active[index] += 1
            self.units[index].finish_gather()
        self._prefetch(self.forward_trace)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._stack.pop()
        for index in self._users[module]:
            self._active[index] -= 1
            if self._active[index] == 0:
                self._after_use(index)
        if self.state is TrainingState.FORWARD:
            if torch.is_grad_enabled() and self._users[module]:
                self._hook_outputs(module, output)
            if not self._stack:
                self._end_forward()

    def _need(self, index: int, trace: ExecutionTrace) -> None:
        if trace is not self.forward_trace or self._tracing:
            trace.need(index)
        self._prefetched.discard(index)
        self.units[index].start_gather()

    def _after_use(self, index: int) -> None:
        unit = self.units[index]
        if self.state is TrainingState.BACKWARD or unit.persistent:
            return  # in backward, gradients decide (recomputed forwards must not release)
        distance = reuse_distance(self.forward_trace.upcoming(), index, self._numel)
        if (
            distance is not None
            and distance <= self.policy.max_reuse_distance
            and self.stats.live_numel <= self.policy.max_live_numel
        ):
            return  # needed again soon: keep it gathered
        unit.release()

    def _end_forward(self) -> None:
        for unit in self.units:
            if self._active[unit.index] == 0:
                unit.release()
        self._prefetched.clear()
        if self._tracing:
            self.forward_trace.end()
        self._tracing = False
        self.state = TrainingState.IDLE

    def _hook_outputs(self, module: nn.Module, output: Any) -> None:
        hook = functools.partial(self._pre_backward, module)
        for value in tree_flatten(output)[0]:
            if isinstance(value, torch.Tensor) and value.requires_grad:
                value.register_hook(hook)

    # -- backward ---------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        self.state = TrainingState.BACKWARD
        self.backward_trace.begin()
        self._prefetched.clear()

    def _pre_backward(self, module: nn.Module, grad: torch.Tensor) -> None:
        if self.state is not TrainingState.BACKWARD:
            raise RuntimeError(OUTSIDE_ENGINE_BACKWARD)
        needed = self._users[module]
        for index in needed:
            self._need(index, self.backward_trace)
        for index in needed:
            self.units[index].finish_gather()
        self._prefetch(self.backward_trace)

    def release_after_backward(self, unit: ShardedUnit) -> None:
        """The unit's gradients are complete: nothing later in this backward reads its weights."""
        self._prefetched.discard(unit.index)
        if self._active[unit.index] == 0:
            unit.release()

    def end_backward(self) -> None:
        for unit in self.units:
            if self._active[unit.index] == 0:
                unit.release()
        self._prefetched.clear()
        self.backward_trace.end()
        self.state = TrainingState.IDLE

    # -- prefetch ---------------------------------------------------------------------------------
    def _numel(self, index: int) -> int:
        return self.units[index].numel

    def _prefetch(self, trace: ExecutionTrace) -> None:
        if self.policy.prefetch_numel <= 0:
            return
        in_flight = sum(self.units[i].numel for i in self._prefetched)
        for index in prefetch_candidates(
            trace.upcoming(),
            self._numel,
            lambda i: self.units[i].state is not UnitState.SHARDED or self.units[i].persistent,
            prefetch_left=self.policy.prefetch_numel - in_flight,
            live_left=self.policy.max_live_numel - self.stats.live_numel,
            nothing_in_flight=not self._prefetched,
        ):
            self.units[index].start_gather()
            self._prefetched.add(index)

    # -- gathering on demand (stage3_param.ParamOwner) --------------------------------------------
    def param_name(self, param: nn.Parameter) -> str:
        return self._names.get(param, "?")

    def touch(self, param: nn.Parameter) -> contextlib.AbstractContextManager[None] | None:
        """Gather `param`'s unit for the module running now, and remember that this module uses it."""
        unit = self._unit_of.get(param)
        if unit is None or not self._stack:
            return None
        module = self._stack[-1]
        users = self._users[module]
        if unit.index not in users:
            users.append(unit.index)
            _log.debug(
                "%s is used outside the forward of the module that owns it; it is now gathered with %s",
                self.param_name(param),
                type(module).__name__,
            )
        if self.state is TrainingState.FORWARD:
            self._need(unit.index, self.forward_trace)
        unit.finish_gather()
        self._active[unit.index] += 1
        return contextlib.nullcontext()

    def hold(self, units: Sequence[ShardedUnit]) -> None:
        """Gather `units` and keep them until `unhold` (GatheredParameters)."""
        for unit in units:
            unit.start_gather()
        for unit in units:
            unit.finish_gather()
            self._active[unit.index] += 1

    def unhold(self, units: Sequence[ShardedUnit]) -> None:
        for unit in units:
            self._active[unit.index] -= 1
            if self._active[unit.index] == 0 and self.state is TrainingState.IDLE:
                unit.release()

    def unit_of(self, param: nn.Parameter) -> ShardedUnit | None:
        return self._unit_of.get(param)

    def hand_over(self, new_stage: int) -> None:
        """Another engine built over this model (at ZeRO stage `new_stage`) took its parameters
        (runtime.zero.build_zero_stage): stop gathering around module calls for good and free the units'
        stale shards; the owning stage removes its gradient hooks. A forward of this engine then runs the
        model as the other engine holds it (DeepSpeed's engines share parameters). Once only."""
        if self.handed_over:
            return
        if self.on_hand_over is not None:
            self.on_hand_over(new_stage)
        self.handed_over = True
        self.remove_module_hooks()
        for unit in self.units:
            unit.drop_shards()

    def close(self) -> None:
        """Stop gathering around module calls (the owner registration dies with this object)."""
        self.remove_module_hooks()
