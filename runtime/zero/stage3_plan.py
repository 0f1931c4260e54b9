"""ZeRO stage 3 planning: which parameters are gathered together, and by which modules' forwards.

Pure functions over the module tree and parameter sizes (no tensor data is read). A *unit* is the set of
parameters that is all-gathered before a module runs and released after it; every unit gets its own flat
buffers. `plan_units` walks the model top-down and decides:

- every child of a container (`nn.ModuleList`, `nn.ModuleDict`, `nn.Sequential`) is a *block* unit
  holding its whole subtree (a transformer block is gathered at once, as FSDP2 users wrap blocks);
- outside blocks, a module whose own not-yet-placed trainable parameters reach `threshold` elements is a
  *module* unit (an embedding, an output head); its children's small parameters join it;
- everything else joins the nearest enclosing unit; what is left at the top forms the *root* unit, which
  is gathered for the whole forward of the model;
- a parameter reachable from several modules (tied weights) belongs to the first unit that meets it; every
  other module that registers it becomes an extra *user* of that unit, so the unit is gathered whenever
  any of them runs;
- a unit smaller than `threshold` elements is *persistent*: it stays gathered (DeepSpeed's
  stage3_param_persistence_threshold, applied per unit rather than per parameter).

Frozen parameters are not placed in units (they stay resident on every rank).
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, field

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class UnitKind(enum.Enum):
    ROOT = "root"  # the model's own leftovers, gathered for its whole forward
    BLOCK = "block"  # a child of a module container, with its whole subtree
    MODULE = "module"  # a module with large parameters of its own, plus its children's small ones


@dataclass(frozen=True)
class UnitPlan:
    """One gather unit: its parameters (by name) and the modules whose forward needs it."""

    index: int
    kind: UnitKind
    root: str  # name of the module that owns the unit ("" is the model itself)
    params: tuple[str, ...]  # one name per parameter (its first name in `named_parameters` order)
    users: tuple[str, ...]  # modules whose forward gathers it: `root` first, then sharing modules
    numel: int
    persistent: bool

    def describe(self) -> str:
        others = ", ".join(u or "<model>" for u in self.users[1:])
        text = f"unit {self.index} ({self.kind.value} {self.root or '<model>'}): {len(self.params)} params, "
        text += f"{self.numel} elements"
        return (
            text
            + (", persistent" if self.persistent else "")
            + (f", also used by {others}" if others else "")
        )


@dataclass
class _Building:
    kind: UnitKind
    root: str
    params: list[str] = field(default_factory=list)
    users: list[str] = field(default_factory=list)
    numel: int = 0


def plan_units(model: nn.Module, trainable: Collection[nn.Parameter], *, threshold: int) -> list[UnitPlan]:
    """Split the trainable parameters of `model` into gather units (see the module docstring).

    Args:
        model: the model; its module tree and parameter sizes are read, not its values.
        trainable: the parameters the optimizer trains; all others are left out of every unit.
        threshold: elements; modules with at least this many own parameters get a unit, and units
            smaller than this stay gathered.

    Returns:
        Non-empty units in the order the walk met them (the root unit first when it is not empty).
    """
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    wanted = {id(p) for p in trainable}
    placed: dict[int, int] = {}  # id(param) -> unit position in `units`
    units: list[_Building] = [_Building(UnitKind.ROOT, "", users=[""])]
    seen_modules: set[int] = set()

    def add_user(unit: int, name: str) -> None:
        if name not in units[unit].users:
            units[unit].users.append(name)

    def visit(module: nn.Module, name: str, unit: int, in_block: bool, parent: nn.Module | None) -> None:
        if id(module) in seen_modules:  # a module registered twice: its parameters are placed already
            for p in module.parameters():
                if id(p) in placed:
                    add_user(placed[id(p)], name)
            return
        seen_modules.add(id(module))
        own = [
            (pname, p)
            for pname, p in module._parameters.items()
            if p is not None and id(p) in wanted and id(p) not in placed
        ]
        if parent is not None and not in_block:
            if isinstance(parent, _CONTAINERS):
                units.append(_Building(UnitKind.BLOCK, name, users=[name]))
                unit, in_block = len(units) - 1, True
            elif own and sum(p.numel() for _, p in own) >= max(threshold, 1):
                units.append(_Building(UnitKind.MODULE, name, users=[name]))
                unit = len(units) - 1
        for pname, param in module._parameters.items():
            if param is None or id(param) not in wanted:
                continue
            if id(param) in placed:
                if placed[id(param)] != unit:  # tied: this module needs another unit's parameter
                    add_user(placed[id(param)], name)
                continue
            placed[id(param)] = unit
            units[unit].params.append(f"{name}.{pname}" if name else pname)
            units[unit].numel += param.numel()
        for child_name, child in module._modules.items():
            if child is not None:
                visit(child, f"{name}.{child_name}" if name else child_name, unit, in_block, module)

    visit(model, "", 0, False, None)
    missing = wanted - set(placed)
    if missing:
        raise ValueError(
            f"{len(missing)} trainable parameter(s) are not registered in the model's module tree; "
            "ZeRO stage 3 can only shard parameters that belong to a module of the model"
        )
    plans: list[UnitPlan] = []
    for building in units:
        if not building.params:
            continue
        plans.append(
            UnitPlan(
                index=len(plans),
                kind=building.kind,
                root=building.root,
                params=tuple(building.params),
                users=tuple(building.users),
                numel=building.numel,
                persistent=building.numel < threshold,
            )
        )
    return plans
