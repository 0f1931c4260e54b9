"""ZeRO stages as strategy objects behind one small protocol.

The engine talks to a `ZeroStage` and never branches on the stage number itself:

    begin_backward(boundary) -> autograd -> end_backward(boundary)   # gradients reduced as they appear
    grad_pieces()        # this rank's reduced gradients per group, in master-shard order
    write_back()         # updated master shards -> working weights (all-gathered for stages 1 and 2)
    zero_grad()

`build_zero_stage` owns the grouping as well as the strategy, since stage 3 groups by module: stages 0-2
flatten one buffer per optimizer param group; stage 0 and 1 keep full gradients (`ReplicatedGradStage`),
stage 2 keeps a gradient shard (`ShardedGradStage`), stage 3 shards parameters per gather unit
(`ParamShardedStage`, runtime.zero.stage3). With one rank a shard is the whole buffer, so every stage is
the replicated one there (stage 3 too, unless `offload_param` keeps its shards in host memory), or, with
16-bit weights and the optimizer on the device, `AutogradGradStage`, which keeps autograd's own gradient
tensors (`DSLAUNCH_AUTOGRAD_GRADS=0`: the replicated one there too). `Init` and `GatheredParameters` are
ZeRO-3's user-facing context managers.

What the optimizer's placement (runtime.offload) reads of a stage is declared here too, on
`StageGroups`: where the working weights live (`params_sharded`, `units`, `host_param_bytes`) and, on
`ZeroStage`, the partial offload's `offload_split`, which the builder computes where it groups the
parameters and hands each stage's constructor, and stage 3's module-hook `schedule` (None elsewhere), which
the engine's `parameter_offload` wraps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from runtime.comm import Comm
from runtime.config import ZeroConfig
from runtime.zero.common import StageOptions
from runtime.zero.flat import FlatGroup, flatten_group
from runtime.zero.gathered import GatheredParameters, resident_owners
from runtime.zero.init import Init, materialize_params
from runtime.zero.offload_split import RATIO_KEY, OffloadSplit, split_count, whole_group_split
from runtime.zero.one_rank import AutogradGradStage, autograd_grads_on
from runtime.zero.optimizer import GroupSpec
from runtime.zero.partition import FlatLayout, plan_flat_layout
from runtime.zero.replicated import GradientViewsReplaced, ReplicatedGradStage
from runtime.zero.sharded import ShardedGradStage
from runtime.zero.stage3 import (
    build_stage3,
    previous_schedulers,
    resident_unit_groups,
    stage3_options,
    take_whole,
)
from runtime.zero.stage3_param import ParamNotGathered

if TYPE_CHECKING:
    from runtime.zero.stage3_hooks import GatherScheduler
    from runtime.zero.stage3_unit import ShardedUnit

__all__ = [
    "FlatGroup",
    "FlatLayout",
    "GatheredParameters",
    "GradientViewsReplaced",
    "Init",
    "ParamNotGathered",
    "ReplicatedGradStage",
    "ShardedGradStage",
    "StageGroups",
    "StageSetup",
    "ZeroStage",
    "build_zero_stage",
    "flatten_group",
    "plan_flat_layout",
    "shards_optimizer_state",
]


class StageGroups(Protocol):
    """A ZeRO stage's flat groups and what the optimizer's placement (runtime.offload) reads of them: the
    whole stage, or the part of its groups one side of a partial offload holds
    (runtime.offload.partial.StageView)."""

    groups: list[FlatGroup]

    @property
    def stage(self) -> int: ...

    @property
    def grads_are_sharded(self) -> bool:
        """True when each rank's gradients cover only its shard (the norm then needs an all-reduce)."""
        ...

    @property
    def params_sharded(self) -> bool:
        """True when the working weights are this rank's shards of gather units (stage 3 with several
        ranks, or with `offload_param`): updated weights go into `units`' shards, not a full buffer."""
        ...

    @property
    def units(self) -> Sequence[ShardedUnit]:
        """Stage 3's gather units when `params_sharded`; empty otherwise."""
        ...

    def grad_pieces(self) -> list[list[torch.Tensor]]:
        """This rank's reduced gradients per group, in master-shard order."""
        ...

    def host_param_bytes(self) -> int:
        """Working-weight bytes in host memory (the shards under `offload_param`; 0 otherwise)."""
        ...

    def write_back(self) -> None:
        """Updated master shards into the working weights (all-gathered for stages 1 and 2)."""
        ...


class ZeroStage(StageGroups, Protocol):
    """A ZeRO stage as the engine drives it (the module docstring has the order of the calls)."""

    # `offload_optimizer.ratio` between 0 and 1: which groups keep their optimizer state on the host and
    # which on the device (runtime.zero.offload_split); None when nothing is split
    offload_split: OffloadSplit | None
    # called once another engine took the model over (after `check_owned` starts refusing): the engine
    # frees what only its backward and step read
    on_taken_over: Callable[[], None] | None

    @property
    def schedule(self) -> GatherScheduler | None:
        """Stage 3's module-hook scheduler, which gathers and releases units around each module (what
        DeepSpeed's `parameter_offload` removes and re-adds around `generate()`); None where every weight
        stays whole (stages 0-2, and stage 3 with one rank)."""
        ...

    def check_owned(self, what: str) -> None:
        """Raise `takeover.ModelTakenOver` once another engine built over this model took it over
        (`what`: "backward" or "step"); the stage's own backward and step check it too."""
        ...

    def begin_backward(self, *, boundary: bool) -> None: ...

    def end_backward(self, *, boundary: bool) -> None: ...

    def zero_grad(self) -> None: ...

    def param_bytes(self) -> int: ...

    def grad_bytes(self) -> int: ...

    def buffer_bytes(self) -> int: ...

    def close(self) -> None: ...


def shards_optimizer_state(stage: int) -> bool:
    """Whether master weights and optimizer state are split across ranks at this stage."""
    return stage >= 1


@dataclass(frozen=True)
class StageSetup:
    """What a stage needs, besides the model and its param groups, to group and shard parameters."""

    zero: ZeroConfig
    param_dtype: torch.dtype
    master_dtype: torch.dtype
    reduce_dtype: torch.dtype | None
    device: torch.device
    pre_reduce_scale: float = 1.0
    bucket_cap: int | None = None  # at most this many elements a bucket, whatever reduce_bucket_size says
    # (the optimizer offload's, with one rank: OffloadSettings.bucket_cap); None: no cap
    # False for an engine without an optimizer (DeepSpeed's inference engine): nothing is ever updated, so
    # the masters are the working weights themselves, unsharded at stages 1-2, and no gradient buffer exists
    trains: bool = True

    @property
    def split_ratio(self) -> float:
        """The host's share of the optimizer state that the stage splits its groups by:
        `offload_optimizer.ratio` when the optimizer is offloaded, 1.0 (nothing to split) otherwise."""
        offload = self.zero.offload_optimizer
        if offload.device == "none" or not self.trains:
            return 1.0
        if offload.ratio is None:  # the engine resolves "auto" first (runtime.offload.with_auto_ratio)
            raise ValueError(f'{RATIO_KEY} "auto" must be resolved before the ZeRO stage is built')
        return offload.ratio


def build_zero_stage(
    model: nn.Module, specs: Sequence[GroupSpec], comm: Comm, setup: StageSetup
) -> ZeroStage:
    """Group and flatten the trainable parameters of `model` the way its stage wants, and build the
    stage's strategy over them; `stage.groups` are the flat groups the optimizer then steps (one
    optimizer param group each; `group.spec_index` says which of `specs` it came from)."""
    stage = setup.zero.stage
    if not setup.trains:  # the masters alias the working weights (flatten_group, build_segment)
        setup = replace(setup, master_dtype=setup.param_dtype)
    if stage not in (0, 1, 2, 3):
        raise NotImplementedError(f"zero_optimization.stage {stage} does not exist; use 0, 1, 2 or 3")
    registration = {p: i for i, p in enumerate(model.parameters())}
    # engines built over this model before: their copies are stale then, their hooks come off
    residents, schedulers = resident_owners(model), previous_schedulers(model)
    built = _build(model, specs, comm, setup, registration)
    for owner in residents:
        owner.hand_over(stage)
    for scheduler in schedulers:  # stage 3 hands its own over as it builds (build_stage3): once only
        scheduler.hand_over(stage)
    return built


def _build(
    model: nn.Module,
    specs: Sequence[GroupSpec],
    comm: Comm,
    setup: StageSetup,
    registration: dict[nn.Parameter, int],
) -> ZeroStage:
    """The stage's groups and strategy (build_zero_stage, once the setup is final)."""
    stage = setup.zero.stage
    if stage == 3:
        options = stage3_options(setup)
        # One rank gains nothing from sharding, except when the shards are to live in host memory.
        if comm.world_size > 1 or setup.zero.offload_param.enabled:
            return build_stage3(model, specs, comm, options, registration=registration)
        groups = resident_unit_groups(model, specs, comm, options)
        split = whole_group_split(groups, setup.split_ratio, registration)
    else:
        # whole again: those another engine's stage 3 shards (gathered from its units), those zero.Init made
        take_whole(list(model.parameters()), setup.device)
        materialize_params(model.parameters())
        model.to(setup.device)
        groups, split = _flatten_specs(model, specs, comm, setup, registration)
    hooked = StageOptions(
        registration=registration,
        overlap_comm=setup.zero.overlap_comm,
        pre_reduce_scale=setup.pre_reduce_scale,
        reduce_dtype=setup.reduce_dtype,
        offload_split=split,
        trains=setup.trains,
    )
    if stage == 2 and comm.world_size > 1 and setup.trains:
        return ShardedGradStage(groups, comm, hooked)
    if _autograd_grads(comm, setup):
        return AutogradGradStage(stage, groups, comm, hooked)
    return ReplicatedGradStage(stage, groups, comm, hooked)


def _autograd_grads(comm: Comm, setup: StageSetup) -> bool:
    """One rank keeps autograd's own gradient tensors (runtime/zero/one_rank.py) unless told not to, where
    nothing reads a flat buffer of them: 16-bit weights with their own masters, the optimizer on the
    device."""
    return (
        comm.world_size == 1
        and setup.trains
        and setup.param_dtype != setup.master_dtype
        and setup.zero.offload_optimizer.device == "none"
        and autograd_grads_on()
    )


def _flatten_specs(
    model: nn.Module,
    specs: Sequence[GroupSpec],
    comm: Comm,
    setup: StageSetup,
    registration: dict[nn.Parameter, int],
) -> tuple[list[FlatGroup], OffloadSplit | None]:
    """Stages 0-2: one flat group per param group, sharded for stages 1 and 2; with
    `offload_optimizer.ratio` between 0 and 1, two per param group: the parameters whose gradients are
    ready first (their optimizer state on the host) and the rest (on the device). Returns the groups and
    the `OffloadSplit` (None without a ratio that splits)."""
    names = {p: n for n, p in model.named_parameters()}
    # an engine that trains nothing keeps whole masters: they are then the working buffer itself
    sharded = shards_optimizer_state(setup.zero.stage) and comm.world_size > 1 and setup.trains
    shard_world, shard_rank = (comm.world_size, comm.rank) if sharded else (1, 0)
    bucket_numel = setup.zero.reduce_bucket_size
    if setup.bucket_cap is not None:
        bucket_numel = min(bucket_numel, setup.bucket_cap)
    ratio = setup.split_ratio
    groups: list[FlatGroup] = []
    host: list[int] = []
    for index, spec in enumerate(specs):
        # reverse registration order: buckets then fill in the order backward produces gradients
        params = sorted(spec.params, key=lambda p: -registration.get(p, -1))
        sides = [(False, params)]
        if ratio != 1.0:
            count = split_count([p.numel() for p in params], ratio)
            sides = [(True, params[:count]), (False, params[count:])]
        # each side as one flat group per wire dtype (torch_autocast.lower_precision_safe_modules)
        parts = [(on_host, part) for on_host, side in sides for part in spec.wire_parts(side)]
        for on_host, part in parts:
            host += [len(groups)] if on_host else []
            group = flatten_group(
                len(groups),
                part,
                spec.options,
                world_size=shard_world,
                rank=shard_rank,
                bucket_numel=bucket_numel,
                param_dtype=setup.param_dtype,
                master_dtype=setup.master_dtype,
                device=setup.device,
                names=[names[p] for p in part],
            )
            group.spec_index = index
            group.reduce_dtype = spec.wire_dtype(part)
            groups.append(group)
    if ratio == 1.0:
        return groups, None
    return groups, OffloadSplit.of(ratio, host, [g.param_numel for g in groups])
