"""Partial optimizer offload (`offload_optimizer.ratio`, DeepSpeed's ZeRO-Offload++): which groups' optimizer
state goes to the host, as pure functions of parameter sizes.

The ZeRO stage owns it because the split happens where it groups the parameters (`build_zero_stage`);
the offload's `PartialMasters` (runtime/offload/partial.py) places the groups it names.

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

import math
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class RatioChoice:
    """The share of the optimizer state to put on the host, and why (the engine logs the reason)."""

    ratio: float
    reason: str


def choose_ratio(
    *,
    shard_numel: int,
    device_bytes_per_element: int,
    host_bytes_per_element: int,
    device_free: int,
    activation_bytes: int,
    device_reserve: int,
    host_available: int,
    step_bytes_per_element: int = 0,
    step: float = 0.01,
) -> RatioChoice:
    """`"ratio": "auto"`: the largest device share of the optimizer state that fits beside the rest.

    Args:
        shard_numel: this rank's optimizer shard, in elements (what either side can hold).
        device_bytes_per_element: what an element of state costs on the device at the step's peak: the
            fp32 master (unless it is the working weights themselves), the optimizer's moments, and the
            fp32 gradient copy the step makes from 16-bit gradients (16 for Adam with bf16 weights).
        host_bytes_per_element: the same on the host, with the offload's landing buffers (14 or 16).
        device_free: device bytes free once the working weights and gradient buffers exist.
        activation_bytes: the activations' peak estimate for the configured micro-batch.
        device_reserve: what to leave free besides (allocator fragmentation, temporaries, communication).
        host_available: host bytes this rank may still allocate.
        step_bytes_per_element: device bytes an element of the device's share costs only during the
            optimizer step, after backward has freed the activations (the fp32 gradient copy, and room
            for its single allocation): they take the activations' place, not a place beside them.
        step: the ratio is a multiple of this, rounded towards the host, so the device share stays
            inside its budget (the split then takes at least that share to the host: `at_least`).

    Returns the ratio (0.0: all of the state fits on the device) and a reason naming the numbers; raises
    ValueError, naming them and what would fit, when the device and the host together cannot hold it.
    """
    if min(shard_numel, device_bytes_per_element, host_bytes_per_element) <= 0:
        raise ValueError("choose_ratio needs a positive shard size and positive bytes per element")
    gib = 1 << 30
    budget = max(0, device_free - activation_bytes - device_reserve)
    on_device = min(shard_numel, budget // device_bytes_per_element)
    if step_bytes_per_element:  # the step's peak: the state and the step's buffers, without activations
        at_step = max(0, device_free - device_reserve) // (device_bytes_per_element + step_bytes_per_element)
        on_device = min(on_device, at_step)
    ratio = 1.0 - on_device / shard_numel
    ratio = min(1.0, math.ceil(round(ratio / step, 9)) * step)  # whole steps, towards the host
    ratio = round(ratio, 6)
    host_need = math.ceil(ratio * shard_numel) * host_bytes_per_element
    device_use = (shard_numel - math.ceil(ratio * shard_numel)) * device_bytes_per_element
    spare = f"{budget / gib:.1f} GiB of the device's {device_free / gib:.1f} GiB free after the activations "
    spare += f"({activation_bytes / gib:.1f} GiB) and a reserve of {device_reserve / gib:.1f} GiB"
    if step_bytes_per_element:
        step_gib = (shard_numel - math.ceil(ratio * shard_numel)) * step_bytes_per_element / gib
        spare = (
            f"the device's {device_free / gib:.1f} GiB free, less a reserve of "
            f"{device_reserve / gib:.1f} GiB, "
            f"beside the activations ({activation_bytes / gib:.1f} GiB) in forward and backward and the "
            f"step's buffers ({step_gib:.1f} GiB) after them"
        )
    if host_need > host_available:
        fits = on_device + host_available // host_bytes_per_element
        raise ValueError(
            f"the optimizer state of this rank's {shard_numel:,} elements does not fit: the device can hold "
            f"{on_device:,} of them ({spare}) and the host the rest only with {host_need / gib:.1f} GiB, of "
            f"{host_available / gib:.1f} GiB available; both together hold about {fits:,} elements"
        )
    device_gib = device_use / gib
    if ratio == 0.0:
        return RatioChoice(0.0, f"ratio 0: all of the optimizer state ({device_gib:.1f} GiB) fits in {spare}")
    if ratio == 1.0:
        host = f"{host_need / gib:.1f} GiB of {host_available / gib:.1f} GiB available"
        why = f"ratio 1: no optimizer state fits on the device ({spare}); the host holds all of it ({host})"
        return RatioChoice(1.0, why)
    return RatioChoice(
        ratio,
        f"ratio {ratio:g}: the device keeps {1 - ratio:.0%} of the optimizer state ({device_gib:.1f} GiB), "
        f"what fits in {spare}; the host holds the rest ({host_need / gib:.1f} GiB of "
        f"{host_available / gib:.1f} GiB available)",
    )
