"""`runtime.zero.GatheredParameters`: full parameter values outside a forward, for reading or changing.

    with runtime.zero.GatheredParameters(model.head.weight, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model.head.weight.mul_(0.5)
    # every rank now holds its shard of the halved weight, fp32 master included

Every rank must enter and leave the context together (gathering and broadcasting are collectives).
Inside it the parameters are ordinary full tensors. On exit, without `modifier_rank` the values are
dropped (changes are lost); with `modifier_rank=r`, rank r's values are broadcast to all ranks and every
rank stores its slice into its shard: the working shard *and* the fp32 master the optimizer steps, so a
change survives the next optimizer step (only the changed parameters' masters are rewritten, so the
others keep their full precision). For parameters the engine keeps whole (stages 0-2, or one rank),
entering is free and a modification is still broadcast and written into the master.

The same mechanism gathers the 16-bit weights unit by unit for `gathered_state_dict` (save_16bit_model).
Parameters gathered here are for use outside autograd: release on exit happens even if a graph still
refers to them, so compute losses through the modules, not on parameters held in this context.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runtime.comm import Comm
from runtime.zero import init as zero_init
from runtime.zero import stage3_param
from runtime.zero.flat import FlatGroup
from runtime.zero.stage3_hooks import GatherScheduler
from runtime.zero.stage3_unit import ShardedUnit


class ResidentGroups:
    """ParamOwner for parameters whose working copy is always whole (views of a FlatGroup's working
    buffer): GatheredParameters then only needs to broadcast changes and refresh the master."""

    def __init__(self, groups: Iterable[FlatGroup], comm: Comm) -> None:
        self.comm = comm
        # the stage that owns these groups, told when another engine takes the model over (its hooks go)
        self.on_hand_over: Callable[[int], None] | None = None
        self._where: dict[nn.Parameter, tuple[FlatGroup, int]] = {}
        for group in groups:
            for i, param in enumerate(group.params):
                self._where[param] = (group, i)
                stage3_param.register(param, self)

    def param_name(self, param: nn.Parameter) -> str:
        group, i = self._where[param]
        return group.param_names[i] if group.param_names else "?"

    def touch(self, param: nn.Parameter) -> None:
        return None  # never released

    def write_master(self, params: Iterable[nn.Parameter]) -> None:
        """Copy this rank's pieces of the (changed) working values of `params` into the master."""
        with torch.no_grad():
            for param in params:
                group, i = self._where[param]
                if group.master_is_alias:
                    continue
                slot = group.layout.slots[i]
                master = group.master.detach()
                for piece in group.layout.param_pieces(group.rank):
                    if piece.param == i:
                        source = group.working.narrow(0, slot.offset + piece.param_offset, piece.numel)
                        master.narrow(0, piece.shard_offset, piece.numel).copy_(source)

    def close(self) -> None:
        for param in self._where:
            stage3_param.unregister(param)

    def hand_over(self, new_stage: int) -> None:
        """Another engine built over this model (at ZeRO stage `new_stage`) flattened its parameters into
        buffers of its own (runtime.zero.build_zero_stage): these groups' buffers are stale copies, freed
        here, so an engine without an optimizer that a training engine followed (TRL's precomputed
        reference pass at ZeRO 0-2) holds nothing; the owning stage removes its gradient hooks and refuses
        a backward or step of this engine (runtime.zero.takeover)."""
        if self.on_hand_over is not None:
            self.on_hand_over(new_stage)
        groups = {id(group): group for group, _ in self._where.values()}
        for group in groups.values():
            group.working = group.working.new_empty(0)
            group.master = nn.Parameter(group.master.detach().new_empty(0))


def resident_owners(model: nn.Module) -> list[ResidentGroups]:
    """The `ResidentGroups` of engines built over `model` before (its parameters' owners now)."""
    found: dict[int, ResidentGroups] = {}
    for param in model.parameters():
        owner = stage3_param.owner_of(param)
        if isinstance(owner, ResidentGroups):
            found[id(owner)] = owner
    return list(found.values())


class GatheredParameters:
    """Gather `params` for the body of a `with` block (see the module docstring).

    Args:
        params: a parameter or an iterable of them (None entries and non-parameters are ignored).
        modifier_rank: the rank whose changes are kept and broadcast; None discards changes.
        fwd_module: accepted for DeepSpeed compatibility; not needed here.
        enabled: False makes the context do nothing.
    """

    def __init__(
        self,
        params: torch.Tensor | Iterable[torch.Tensor | None],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        seen: set[int] = set()
        self.params: list[nn.Parameter] = []
        for param in params:
            if isinstance(param, nn.Parameter) and id(param) not in seen:
                seen.add(id(param))
                self.params.append(param)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._units: list[tuple[GatherScheduler, list[ShardedUnit]]] = []  # (scheduler, units) held open
        self._init_params: list[nn.Parameter] = []

    def __enter__(self) -> list[nn.Parameter]:
        if not self.enabled:
            return self.params
        schedulers: dict[int, tuple[GatherScheduler, list[ShardedUnit]]] = {}
        for param in self.params:
            scheduler, unit = _unit_of(param)
            if scheduler is not None and unit is not None:
                entry = schedulers.setdefault(id(scheduler), (scheduler, []))
                if unit not in entry[1]:
                    entry[1].append(unit)
            elif zero_init.is_init_sharded(param):
                self._init_params.append(param)
        self._units = list(schedulers.values())
        for scheduler, units in self._units:
            scheduler.hold(units)
        zero_init.gather_params(self._init_params)
        return self.params

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enabled:
            return
        modify = self.modifier_rank is not None and exc_type is None
        try:
            if modify:
                self._broadcast_and_store()
        finally:
            zero_init.release_params(self._init_params, keep_changes=modify)
            for scheduler, units in self._units:
                scheduler.unhold(units)

    def _broadcast_and_store(self) -> None:
        assert self.modifier_rank is not None
        for param in self.params:
            comm = _comm_of(param)
            if comm is None:
                continue
            with torch.no_grad():
                data = param.detach()
                if data.is_contiguous():
                    comm.broadcast(data, self.modifier_rank)
                else:  # pragma: no cover - parameters here are contiguous views
                    buffer = data.contiguous()
                    comm.broadcast(buffer, self.modifier_rank)
                    data.copy_(buffer)
        changed = set(self.params)
        for _, units in self._units:
            for unit in units:
                unit.write_shards_from_working(changed)
        resident: dict[int, tuple[ResidentGroups, list[nn.Parameter]]] = {}
        for param in self.params:
            owner = stage3_param.owner_of(param)
            if isinstance(owner, ResidentGroups):
                resident.setdefault(id(owner), (owner, []))[1].append(param)
        for owner, params in resident.values():
            owner.write_master(params)


def _comm_of(param: nn.Parameter) -> Comm | None:
    """The group a parameter is sharded (or replicated) over; None for a parameter no engine manages."""
    _, unit = _unit_of(param)
    if unit is not None:
        return unit.comm
    owner = stage3_param.owner_of(param)
    if isinstance(owner, ResidentGroups):
        return owner.comm
    return zero_init.shard_comm(param)


def gathered_state_dict(module: nn.Module, *, rank0_only: bool = True, device: str = "cpu") -> dict[str, Any]:
    """The module's state dict with every parameter gathered (working dtype), built unit by unit so at
    most one unit is gathered at a time. Every rank must call it; other ranks get {} when rank0_only."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    keep = not rank0_only or rank == 0
    names: dict[nn.Parameter, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(name)
    values: dict[str, torch.Tensor] = {}
    for batch in _gather_batches(list(names)):
        with GatheredParameters(batch):
            if keep:
                for param in batch:
                    value = param.detach().to(device, copy=True)
                    for name in names[param]:
                        values[name] = value
    if not keep:
        return {}
    out: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if key in values:
            out[key] = values[key]
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().to(device, copy=True)
        else:
            out[key] = value
    return out


def _gather_batches(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters grouped so each batch gathers one unit (or one Init-sharded/resident parameter)."""
    batches: dict[int, list[nn.Parameter]] = {}
    order: list[int] = []
    for param in params:
        _, unit = _unit_of(param)
        key = id(unit) if unit is not None else id(param)
        if key not in batches:
            batches[key] = []
            order.append(key)
        batches[key].append(param)
    return [batches[k] for k in order]


def is_sharded(param: nn.Parameter) -> bool:
    """Whether `param`'s values are split across ranks (ZeRO-3 unit or zero.Init), gathered now or not."""
    return _unit_of(param)[1] is not None or zero_init.is_init_sharded(param)


def _unit_of(param: nn.Parameter) -> tuple[GatherScheduler | None, ShardedUnit | None]:
    """The engine's stage-3 scheduler that owns `param`, and its gather unit (None, None for a parameter
    another owner holds: zero.Init's, a resident group's, or none)."""
    owner = stage3_param.owner_of(param)
    if not isinstance(owner, GatherScheduler):
        return None, None
    return owner, owner.unit_of(param)


def save_16bit_state_dict(module: nn.Module, path: str | os.PathLike, *, allow_gather: bool) -> bool:
    """Write the module's working-dtype state dict to `path` on rank 0 (every rank must call it).

    Sharded parameters are gathered unit by unit onto rank 0's host memory, which a run must allow with
    zero_optimization.stage3_gather_16bit_weights_on_model_save; without it this raises instead of
    writing a file with empty tensors. Returns True on the rank that wrote the file.
    """
    if not allow_gather and any(is_sharded(p) for p in module.parameters()):
        raise ValueError(
            "save_16bit_model: the parameters are sharded by ZeRO stage 3, and gathering them onto rank 0 "
            'is off; set "zero_optimization": {"stage3_gather_16bit_weights_on_model_save": true}, or '
            "save with engine.save_checkpoint() / engine.full_state_dict() instead"
        )
    state = gathered_state_dict(module, rank0_only=True)
    if not state:
        return False
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, target)  # a reader never sees a half-written file
    return True
