"""Partial optimizer offload (`offload_optimizer.ratio`, DeepSpeed's ZeRO-Offload++): which groups' optimizer
state goes to the host, as pure functions of parameter sizes.

The ZeRO stage owns it because the split happens where it groups the parameters (`build_zero_stage`,
which hands it on as the stage's `offload_split`); the offload's `PartialMasters`
(runtime/offload/partial.py) places the groups it names. A `"ratio": "auto"` is a number before this
runs: the offload chooses it from the machine's memory (runtime/offload/auto_ratio.py).

`ratio` is the share of the optimizer state (fp32 masters and moments) kept in host memory and updated
there (1.0, the default: all of it; 0.0: none, as without offload); the rest stays on the training
device and the device's optimizer updates it while the host updates its share
(runtime/offload/partial.py).

Granularity: whole parameters, never a range inside one. Each side then holds whole flat groups, so
neither placement (`DeviceMasters`, `HostMasters`) needs to handle a sub-range of a group.

- Stages 1 and 2 build one flat group per param group; with a ratio between 0 and 1 the stage splits each
  param group's parameters in two (`split_count`): the host takes the parameters whose gradients are
  ready first in backward, and the device the rest. Why that way round: the host's update is the slow
  one, and it can start earliest that way (with one rank the host updates each bucket during backward
  as it lands, runtime/offload/step/streamed.py; with more ranks its landing copies start first), while
  the device updates its share at memory bandwidth after backward. The two halves keep the param
  group's options (`spec_index`), so checkpoints map them back by parameter name.
- Stage 3 already has one flat group per gather unit and param group: whole groups go to the host in the
  order their gradients are ready (`plan_split`), by the same rule.

The host side gets the prefix (in readiness order) whose element count is nearest to `ratio` of the
total; with coarse parameters the achieved share differs from the requested one, and the engine logs
both. Every rank decides from the same numbers (whole parameters' sizes, not shard sizes), so all ranks
place the same groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from runtime.zero.flat import FlatGroup

RATIO_KEY = "zero_optimization.offload_optimizer.ratio"


def check_ratio(ratio: float) -> float:
    """`ratio` as a float, or ValueError naming the key when it is outside [0, 1]."""
    value = float(ratio)
    if not 0.0 <= value <= 1.0:  # also false for nan
        raise ValueError(
            f"{RATIO_KEY} must be between 0 and 1 (the share of the optimizer on the host), got {ratio}"
        )
    return value


def split_count(numels: Sequence[int], ratio: float, *, at_least: bool = False) -> int:
    """How many leading items of `numels` (sizes in the order their gradients are ready) go to the host: the
    prefix whose total is nearest to `ratio` of the whole, the shorter prefix on a tie; with `at_least`,
    the shortest prefix holding at least `ratio` of it (what a ratio chosen to fit the device needs). 0.0
    gives none and 1.0 all of them, whatever the sizes."""
    ratio = check_ratio(ratio)
    if ratio == 0.0:
        return 0
    if ratio == 1.0:
        return len(numels)
    target = ratio * sum(numels)
    best, best_gap, running = 0, target, 0
    for count, numel in enumerate(numels, start=1):
        running += numel
        if at_least and running >= target:
            return count
        gap = abs(running - target)
        if gap < best_gap:
            best, best_gap = count, gap
    return len(numels) if at_least else best


@dataclass(frozen=True)
class OffloadSplit:
    """Which flat groups (positions in the stage's group list) keep their optimizer state on the host and
    which on the device, and the share of the elements that is on the host."""

    ratio: float  # what the config asked for
    host: tuple[int, ...]
    device: tuple[int, ...]
    host_numel: int  # parameter elements (whole parameters, every rank's together) on each side
    device_numel: int

    @property
    def achieved(self) -> float:
        total = self.host_numel + self.device_numel
        return self.host_numel / total if total else 0.0

    @property
    def partial(self) -> bool:
        """Both sides hold groups (else one plain placement does the job)."""
        return bool(self.host) and bool(self.device)

    @classmethod
    def of(cls, ratio: float, host: Sequence[int], numels: Sequence[int]) -> OffloadSplit:
        """The split with the groups at positions `host` on the host, of groups sized `numels`."""
        on_host = set(host)
        device = tuple(i for i in range(len(numels)) if i not in on_host)
        return cls(
            ratio=float(ratio),
            host=tuple(sorted(on_host)),
            device=device,
            host_numel=sum(numels[i] for i in on_host),
            device_numel=sum(numels[i] for i in device),
        )


def plan_split(numels: Sequence[int], ready: Sequence[int], ratio: float) -> OffloadSplit:
    """Whole groups to the host: `numels[i]` is group i's parameter elements, `ready[i]` the rank of its
    gradients in backward (smaller: ready earlier; ties keep the group order). The host takes the prefix
    in that order that `split_count` picks."""
    if len(ready) != len(numels):
        raise ValueError(f"{len(numels)} group sizes but {len(ready)} readiness keys")
    order = sorted(range(len(numels)), key=lambda i: (ready[i], i))
    count = split_count([numels[i] for i in order], ratio)
    return OffloadSplit.of(ratio, order[:count], numels)


def whole_group_split(
    groups: Sequence[FlatGroup], ratio: float, registration: Mapping[nn.Parameter, int]
) -> OffloadSplit | None:
    """Stage 3's groups (one per gather unit and param group) split by `ratio`: whole groups go to the
    host, those whose gradients are ready first in backward (`plan_split`); `registration` is each
    parameter's index in `model.parameters()`. None when the ratio splits nothing (1.0)."""
    if ratio == 1.0:
        return None
    # backward finishes a group when its earliest-registered parameter is done (runtime.zero.buckets)
    ready = [-min((registration.get(p, -1) for p in g.params), default=-1) for g in groups]
    return plan_split([g.param_numel for g in groups], ready, ratio)


def describe_split(
    split: OffloadSplit, host_shard: int, device_shard: int, *, state_bytes_per_element: int = 12
) -> str:
    """One log line: this rank's shard elements and optimizer bytes on each side, and the ratio achieved.
    `state_bytes_per_element`: fp32 master and two Adam moments by default."""
    host_bytes = _size(host_shard * state_bytes_per_element)
    device_bytes = _size(device_shard * state_bytes_per_element)
    return (
        f"{RATIO_KEY} {split.ratio:g}: {len(split.host)} flat group(s) on the host, "
        f"{len(split.device)} on the device; this rank's optimizer shard: {host_shard:,} elements on "
        f"the host ({host_bytes} of master and Adam moments), {device_shard:,} on the device "
        f"({device_bytes}); achieved share on the host {split.achieved:.3f} (whole parameters go to one "
        "side)"
    )


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
