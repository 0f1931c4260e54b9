"""ZeRO stage 3: parameters, gradients and optimizer state all sharded; weights gathered per unit.

`build_stage3` owns the grouping: it plans gather units over the model (stage3_plan), shards each unit's
parameters per optimizer param group into flat segments (stage3_unit), and returns the strategy the
engine drives through the `ZeroStage` protocol:

    forward   module hooks gather a unit before its module runs and release it after (stage3_hooks)
    backward  hooks gather again; when a unit's last gradient is accumulated, its gradients are
              reduce-scattered into this rank's gradient shard and the unit is released
    step      the engine steps the fp32 master shards; `write_back` copies them into the working
              shards (no all-gather: the next forward gathers)

Per step each rank moves the parameters twice (forward and backward all-gathers) and the gradients once
(reduce-scatter): 1.5x the volume of stages 1 and 2 (ZeRO paper, section 7).

With `offload_param: {device: cpu}` (needs offload_optimizer cpu) each rank's working shards live in host
memory (pinned with CUDA): a gather uploads the shard into its chunk of the working buffer first, the
host optimizer step writes the new weights straight into the shard, and the device holds only the
gathered units and the gradient shards.

With one rank nothing is sharded: units become plain flat groups under the replicated strategy (the
gather of a 1-rank unit is the buffer itself), so stage 3 costs what stage 0 costs there.

A model another engine's stage 3 already shards (TRL's precomputed reference pass wraps the policy in an
inference engine before the Trainer's engine takes it) is taken over: each of its parameters is gathered
from the other engine's unit while this engine builds its own, then the other engine's module hooks come
off and its stale shards are freed, so both engines run the one model, as DeepSpeed's share their
partitioned parameters.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from runtime.comm import Comm, Pending
from runtime.host_memory import HostMemory
from runtime.zero import init as zero_init
from runtime.zero import stage3_param
from runtime.zero.common import InFlight
from runtime.zero.flat import FlatGroup, flatten_group
from runtime.zero.gathered import GatheredParameters
from runtime.zero.offload_split import OffloadSplit, whole_group_split
from runtime.zero.optimizer import GroupSpec
from runtime.zero.stage3_hooks import OUTSIDE_ENGINE_BACKWARD, GatherPolicy, GatherScheduler
from runtime.zero.stage3_plan import UnitPlan, plan_units
from runtime.zero.stage3_unit import GatherStats, Segment, ShardedUnit, UnitState, build_segment
from runtime.zero.stage3_upload import ShardUploads
from runtime.zero.takeover import TakeOver

if TYPE_CHECKING:
    from runtime.zero import StageSetup

_log = logging.getLogger("runtime.zero.stage3")


@dataclass(frozen=True)
class Stage3Options:
    """What stage 3 needs from the config and the precision policy."""

    param_dtype: torch.dtype
    master_dtype: torch.dtype
    reduce_dtype: torch.dtype | None
    device: torch.device
    persistence_threshold: int
    policy: GatherPolicy
    overlap_comm: bool = True
    pre_reduce_scale: float = 1.0
    max_in_flight: int = 2  # reduce-scatters waiting on the network at once
    offload_param: bool = False  # working shards in host memory (zero_optimization.offload_param cpu)
    pin_memory: bool = False  # pin those shards (only ever with CUDA)
    split_ratio: float = 1.0  # partial optimizer offload: the host's share (StageSetup.split_ratio)
    trains: bool = True  # False: an engine without an optimizer (no gradient shards, no gradient hooks)


class ParamShardedStage:
    """Stage 3 with more than one rank."""

    stage = 3

    def __init__(
        self,
        model: nn.Module,
        units: Sequence[ShardedUnit],
        comm: Comm,
        options: Stage3Options,
        names: dict[nn.Parameter, str],
        host: HostMemory | None = None,
        *,
        offload_split: OffloadSplit | None = None,
        uploads: ShardUploads | None = None,
    ) -> None:
        self.comm = comm
        self.host = host  # the HostMemory of offloaded shards (offload_param), released by close()
        self.options = options
        self.units = list(units)
        self.groups: list[FlatGroup] = [s.group for u in self.units for s in u.segments]
        self.offload_split = offload_split  # partial optimizer offload: which groups go to the host
        self.uploads = uploads  # offload_param: the host shards' upload stream (stage3_upload)
        self.stats = self.units[0].stats if self.units else GatherStats()
        self.schedule = GatherScheduler(model, self.units, options.policy, names, self.stats)
        self.schedule.on_hand_over = self._taken_over
        self.taken_over: TakeOver | None = None  # another engine built over this model later took it
        self.on_taken_over: Callable[[], None] | None = None  # the engine's, to free what it alone reads
        self._where: dict[nn.Parameter, tuple[ShardedUnit, Segment, int]] = {}
        for unit in self.units:
            for segment in unit.segments:
                for i, param in enumerate(segment.group.params):
                    self._where[param] = (unit, segment, i)
        self._staging: dict[int, torch.Tensor] = {}  # id(segment) -> full-size gradient buffer
        # One rank (stage 3 there means offload_param): a gradient is its own reduction, so it is added
        # straight into the gradient shard, with the rounding the staged path gives it (one, into the
        # shard's dtype). The staged path would hold up to 1 + max_in_flight unit-sized buffers: 3.45 GiB
        # beside a 17.6B model's 617M-element blocks, a twentieth of an 80 GB card.
        self._direct = comm.world_size == 1 and options.pre_reduce_scale == 1.0
        self._touched: set[int] = set()  # id(segment): its shard has taken a gradient in this backward
        self._left: dict[int, int] = {}  # unit index -> gradients still to come in this backward
        self._reduced: set[int] = set()  # units reduce-scattered in this backward
        self._in_flight: list[InFlight] = []
        self._has_grads = False
        for param in self._where:  # a gradient left on the model (another engine's view, a plain backward)
            param.grad = None  # would be added to this engine's first one: autograd accumulates into .grad
        # frozen parameters are sharded too in an engine without an optimizer (DeepSpeed's inference
        # engine, e.g. TRL's reference model); they never produce a gradient, so they get no hook, and
        # such an engine reduces no gradient at all (its backward is refused)
        self._hooks: list[RemovableHandle] = [
            param.register_post_accumulate_grad_hook(self._on_grad)
            for param in self._where
            if param.requires_grad and options.trains
        ]

    @property
    def grads_are_sharded(self) -> bool:
        return True

    @property
    def params_sharded(self) -> bool:
        return True

    # -- backward ---------------------------------------------------------------------------------
    def begin_backward(self, *, boundary: bool) -> None:
        self.check_owned("backward")
        self._left = {u.index: len(u.params) for u in self.units}
        self._reduced = set()
        self._touched = set()
        self.schedule.begin_backward()

    def _on_grad(self, param: nn.Parameter) -> None:
        unit, segment, i = self._where[param]
        if unit.index not in self._left:
            raise RuntimeError(OUTSIDE_ENGINE_BACKWARD)
        if unit.index in self._reduced:
            raise RuntimeError(
                f"{self.schedule.param_name(param)} finished its gradient after its unit was already "
                "reduced in this backward pass; the engine reduces each gradient once per backward "
                "(reentrant activation checkpointing does this: use torch.utils.checkpoint with "
                "use_reentrant=False)"
            )
        slot = segment.group.layout.slots[i]
        grad = param.grad
        if grad is not None:
            if self._direct:
                self._add_to_shard(segment).narrow(0, slot.offset, slot.numel).add_(grad.reshape(-1))
            else:
                self._staging_buffer(segment).narrow(0, slot.offset, slot.numel).copy_(grad.reshape(-1))
            param.grad = None
        self._left[unit.index] -= 1
        if self._left[unit.index] == 0:
            self._reduce(unit)

    def _add_to_shard(self, segment: Segment) -> torch.Tensor:
        """One rank: the gradient shard a gradient is added to, zeroed at its first gradient of a backward
        that overwrites (the staged path's zero-filled buffer, copied in: padding and parameters without
        a gradient this pass contribute nothing)."""
        if id(segment) not in self._touched:
            self._touched.add(id(segment))
            if not self._has_grads:
                segment.grad_shard.zero_()
        return segment.grad_shard

    def _staging_buffer(self, segment: Segment) -> torch.Tensor:
        buffer = self._staging.get(id(segment))
        if buffer is None:
            dtype = segment.group.reduce_dtype or self.options.reduce_dtype or segment.shard.dtype
            # zeros: padding and parameters without a gradient this pass contribute nothing
            buffer = torch.zeros(segment.numel, dtype=dtype, device=segment.grad_shard.device)
            self._staging[id(segment)] = buffer
        return buffer

    def _reduce(self, unit: ShardedUnit) -> None:
        """Reduce-scatter the unit's gradients into the shards, then release its weights."""
        self._reduced.add(unit.index)
        if self._direct:  # the gradients are in the shards already: nothing to reduce
            self.schedule.release_after_backward(unit)
            return
        rank = self.comm.rank
        for segment in unit.segments:
            buffer = self._staging_buffer(segment)
            del self._staging[id(segment)]
            if self.options.pre_reduce_scale != 1.0:
                buffer.mul_(self.options.pre_reduce_scale)
            piece = segment.group.layout.shard_numel
            chunk = buffer.narrow(0, rank * piece, piece)
            mine = segment.grad_shard
            pending = self.comm.reduce_scatter(chunk, buffer, async_op=True)
            after = functools.partial(mine.add_ if self._has_grads else mine.copy_, chunk)
            while len(self._in_flight) >= self.options.max_in_flight:
                self._in_flight.pop(0).finish()
            self._in_flight.append(InFlight(pending, buffer, after))
            if not self.options.overlap_comm:
                self._finish_all()
        self.schedule.release_after_backward(unit)

    def _finish_all(self) -> None:
        records, self._in_flight = self._in_flight, []
        for record in records:
            record.finish()

    def end_backward(self, *, boundary: bool) -> None:
        # Units whose gradients did not all arrive (parameters unused in this pass) are reduced now, in
        # unit order on every rank; units that got no gradient at all need no collective.
        for unit in self.units:
            left = self._left.get(unit.index)
            if left is None or unit.index in self._reduced:
                continue
            if left < len(unit.params) or unit.state is not UnitState.SHARDED:
                self._reduce(unit)
            elif not self._has_grads:
                for segment in unit.segments:
                    segment.grad_shard.zero_()
        self._finish_all()
        self.schedule.end_backward()
        if self.uploads is not None:
            self.uploads.drain()  # the offloaded step may write new weights into the host shards next
        self._has_grads = True
        self._left = {}

    # -- step -------------------------------------------------------------------------------------
    def grad_pieces(self) -> list[list[torch.Tensor]]:
        self.check_owned("step")
        if not self._has_grads:
            for unit in self.units:
                for segment in unit.segments:
                    segment.grad_shard.zero_()
        return [[s.grad_shard] for u in self.units for s in u.segments]

    def write_back(self) -> None:
        launched: list[Pending] = []
        for unit in self.units:
            launched += unit.write_back()
        for pending in launched:
            pending.wait()

    def zero_grad(self) -> None:
        self._has_grads = False  # the next backward overwrites the shards instead of adding

    # -- accounting -------------------------------------------------------------------------------
    def param_bytes(self) -> int:
        """Working weights held now: the shards plus the gathered buffers (storage sizes)."""
        return sum(u.shard_bytes() + u.working_bytes() for u in self.units)

    def host_param_bytes(self) -> int:
        """Of `param_bytes`, the bytes in host memory: the working shards under parameter offload."""
        return sum(u.host_shard_bytes() for u in self.units)

    def grad_bytes(self) -> int:
        return sum(s.grad_shard.numel() * s.grad_shard.element_size() for u in self.units for s in u.segments)

    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._staging.values())

    def unit_of(self, param: nn.Parameter) -> ShardedUnit | None:
        return self.schedule.unit_of(param)

    def _taken_over(self, new_stage: int) -> None:
        """Another engine took the model over (GatherScheduler.hand_over): the gradient hooks come off (one
        of them would refuse the new engine's backward as running outside this engine's), and this stage's
        backward and step are refused from now on."""
        self._finish_all()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.taken_over = TakeOver(self.stage, new_stage)
        if self.on_taken_over is not None:
            self.on_taken_over()

    def check_owned(self, what: str) -> None:
        if self.taken_over is not None:
            raise self.taken_over.error(what)

    def close(self) -> None:
        """Remove the gradient and module hooks. No collective runs here (a rank may close alone), so the
        parameters stay sharded: read them before, or through GatheredParameters while the engine lives."""
        self._finish_all()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.schedule.close()
        if self.host is not None:
            self.host.close()


def stage3_options(setup: StageSetup) -> Stage3Options:
    """Stage 3's settings from a runtime.zero.StageSetup (the config's zero_optimization section)."""
    zero = setup.zero
    offload = zero.offload_param
    return Stage3Options(
        param_dtype=setup.param_dtype,
        master_dtype=setup.master_dtype,
        reduce_dtype=setup.reduce_dtype,
        device=setup.device,
        persistence_threshold=zero.stage3_param_persistence_threshold,
        policy=GatherPolicy(
            prefetch_numel=zero.stage3_prefetch_bucket_size,
            max_live_numel=zero.stage3_max_live_parameters,
            max_reuse_distance=zero.stage3_max_reuse_distance,
        ),
        overlap_comm=zero.overlap_comm,
        pre_reduce_scale=setup.pre_reduce_scale,
        offload_param=offload.enabled,
        pin_memory=offload.pin_memory,
        split_ratio=setup.split_ratio,
        trains=setup.trains,
    )


def build_stage3(
    model: nn.Module,
    specs: Sequence[GroupSpec],
    comm: Comm,
    options: Stage3Options,
    *,
    registration: dict[nn.Parameter, int],
) -> ParamShardedStage:
    """Plan units over `model`, shard its trainable parameters unit by unit (at most one unit is whole at
    a time, also for a model built under zero.Init), and build the strategy (`registration`: each
    parameter's index in `model.parameters()`, which orders the groups for a partial optimizer offload)."""
    previous = previous_schedulers(model)  # gathered back from below, unit by unit
    names, plans, segments = _plan(model, specs, comm, options)
    host = uploads = None
    if options.offload_param:
        host = HostMemory(options.device, pin=options.pin_memory)
        uploads = ShardUploads(options.device)
    stats = GatherStats()
    units: list[ShardedUnit] = []
    index = 0
    for plan in plans:
        built = []
        for spec_index, params in segments[plan.index]:
            values = _full_values(params, options.device)
            built.append(
                build_segment(
                    index,
                    spec_index,
                    params,
                    values,
                    specs[spec_index].options,
                    names=[names[p] for p in params],
                    comm=comm,
                    param_dtype=options.param_dtype,
                    master_dtype=options.master_dtype,
                    device=options.device,
                    host=host,
                    grads=options.trains,
                )
            )
            built[-1].group.reduce_dtype = specs[spec_index].wire_dtype(params)
            del values
            index += 1
            for param in params:
                zero_init.forget(param)
                stage3_param.release(param, dtype=options.param_dtype, device=options.device)
        unit = ShardedUnit(plan, built, comm, stats, uploads=uploads)
        if unit.persistent:
            unit.finish_gather()
        units.append(unit)
    for scheduler in previous:  # the model is this engine's now: the other engine's hooks and shards go
        scheduler.hand_over(3)
    groups = [s.group for u in units for s in u.segments]
    split = whole_group_split(groups, options.split_ratio, registration)
    return ParamShardedStage(model, units, comm, options, names, host, offload_split=split, uploads=uploads)


def previous_schedulers(model: nn.Module) -> list[GatherScheduler]:
    """The stage-3 schedulers of engines built over `model` before this one. TRL's precomputed reference
    pass wraps the policy in an inference engine, then the Trainer builds its training engine over the same
    model; DeepSpeed's engines share the partitioned parameters, so the second one simply takes them."""
    found: dict[int, GatherScheduler] = {}
    for param in model.parameters():
        owner = stage3_param.owner_of(param)
        if isinstance(owner, GatherScheduler):
            found[id(owner)] = owner
    return list(found.values())


def _full_values(params: Sequence[nn.Parameter], device: torch.device) -> list[torch.Tensor]:
    """The full values of one segment's parameters: from zero.Init's shards or the parameters themselves
    (zero_init.full_value), or, for those another engine's stage 3 shards, gathered from its units (held
    together, so a unit it shares with this segment is gathered once)."""
    held = {id(p) for p in params if isinstance(stage3_param.owner_of(p), GatherScheduler)}
    if not held:
        return [zero_init.full_value(p, device) for p in params]
    with GatheredParameters([p for p in params if id(p) in held]):
        return [
            p.detach().to(device, copy=True) if id(p) in held else zero_init.full_value(p, device)
            for p in params
        ]


def take_whole(params: Sequence[nn.Parameter], device: torch.device) -> None:
    """Give the parameters among `params` that another engine's stage 3 shards their full values for good
    (this engine keeps them whole: frozen ones beside its trained groups)."""
    held = [p for p in params if isinstance(stage3_param.owner_of(p), GatherScheduler)]
    for param, value in zip(held, _full_values(held, device), strict=True):
        stage3_param.unregister(param)
        stage3_param.materialize(param, value)


def resident_unit_groups(
    model: nn.Module, specs: Sequence[GroupSpec], comm: Comm, options: Stage3Options
) -> list[FlatGroup]:
    """One rank: the same units as plain flat groups (the shard is the whole buffer, nothing to gather)."""
    names, plans, segments = _plan(model, specs, comm, options)
    groups: list[FlatGroup] = []
    for plan in plans:
        for spec_index, params in segments[plan.index]:
            group = flatten_group(
                len(groups),
                params,
                specs[spec_index].options,
                world_size=1,
                rank=0,
                bucket_numel=sys.maxsize,
                param_dtype=options.param_dtype,
                master_dtype=options.master_dtype,
                device=options.device,
                names=[names[p] for p in params],
            )
            group.spec_index = spec_index
            group.reduce_dtype = specs[spec_index].wire_dtype(params)
            groups.append(group)
    return groups


def _plan(
    model: nn.Module, specs: Sequence[GroupSpec], comm: Comm, options: Stage3Options
) -> tuple[dict[nn.Parameter, str], list[UnitPlan], dict[int, list[tuple[int, list[nn.Parameter]]]]]:
    """Names, unit plans, and per unit its (param group, parameters) segments; resident state placed."""
    spec_of = {p: i for i, spec in enumerate(specs) for p in spec.params}
    names = {p: n for n, p in model.named_parameters()}
    plans = plan_units(model, list(spec_of), threshold=options.persistence_threshold)
    frozen = [p for p in model.parameters() if p not in spec_of]
    zero_init.materialize_params(frozen)  # frozen parameters are not sharded: whole on every rank
    take_whole(frozen, options.device)  # ... also those another engine's stage 3 sharded
    if comm.world_size == 1:
        zero_init.materialize_params(model.parameters())
    with torch.no_grad():
        for param in frozen:
            if param.device != options.device:
                param.data = param.data.to(options.device)
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None and buf.device != options.device:
                    module._buffers[key] = buf.to(options.device)
    by_name = dict(model.named_parameters())
    segments: dict[int, list[tuple[int, list[nn.Parameter]]]] = {}
    for plan in plans:
        by_spec: dict[int, list[nn.Parameter]] = {}
        for name in plan.params:
            param = by_name[name]
            by_spec.setdefault(spec_of[param], []).append(param)
        # one segment per param group and wire dtype (torch_autocast.lower_precision_safe_modules)
        segments[plan.index] = [
            (i, part) for i in sorted(by_spec) for part in specs[i].wire_parts(by_spec[i])
        ]
        _log.debug(plan.describe())
    return names, plans, segments
