"""Partial optimizer offload (`offload_optimizer.ratio` between 0 and 1): some groups' optimizer state on the
host, the others' on the device, both updated in the same step.

`PartialMasters` is the `MasterPlacement` the engine gets then. It composes the two plain placements'
machinery over disjoint sets of whole flat groups (runtime/zero/offload_split.py decides which):
`HostMasters` over the host's groups (landing, the host or device-streamed Adam step, copy-back,
publishing, all unchanged), and `DeviceMasters`' step over the rest (fp32 master gradients,
`finish_grads`, `optimizer.step()`). Each side sees the ZeRO stage through `StageView`, which hands it
only its groups' gradient pieces.

One optimizer: the engine builds one over every group's master (its param groups align with the
stage's groups, `group.index`). The device side attaches `.grad` to its masters only, so torch's step
skips the host's masters (their grad is None) and leaves their state alone; the host side's Adam
(host_adam.py) finds its masters' param groups by identity and never touches the device's. Each side
advances its own masters' step counts once per applied step.

One decision per step: the global gradient norm (clipping, the fp16 overflow skip, the logged norm)
covers both sides. The device side's norm reduction adds the host side's squared norm (from the same
gradients on the device) before the sum over ranks, and keeps the total; the host side's reduction
then takes that total instead of its own. Both see the same norm, so both apply the same clip factor
or skip together.

Overlap: the device side's update is only queued kernels on a GPU, so it is queued first and the host
side's (CPU-bound) step runs while the GPU updates its share. Where the host needs the clip factor as
a number (clipping or the non-finite check), its one synchronisation also waits for the device's Adam:
about 28 bytes of device memory traffic an element, some 50 ms for 6.5B elements on an H200, against
seconds of host step (running the device's step on a side stream would hide it; not done yet). With
one rank and no clipping, the host side's step streams during backward as without a ratio
(streamed.py; under the non-finite check into a second copy that the shared verdict keeps or drops:
speculative.py).

Not supported: the delayed parameter update (delayed.py). It would update the host's share from
gradients one step stale while the device's share is current, a mixed update no other run reproduces;
`enable_delayed_update` refuses with a ratio below 1.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from runtime.comm import Comm, Pending
from runtime.offload.placement import DeviceMasters
from runtime.precision.grad_math import GradMath, GradResult
from runtime.zero import ZeroStage
from runtime.zero.flat import FlatGroup
from runtime.zero.offload_split import RATIO_KEY, OffloadSplit, describe_split
from runtime.zero.stage3_unit import ShardedUnit

_log = logging.getLogger("runtime.offload")


class StageView:
    """The ZeRO stage seen through some of its groups (`positions` in `zero.groups`), as one side's
    placement reads it (`StageGroups`): `grad_pieces` gives theirs, in that order; where the working
    weights live is the stage's own."""

    def __init__(self, zero: ZeroStage, positions: Sequence[int]) -> None:
        self._zero = zero
        self._positions = list(positions)
        self.groups = [zero.groups[i] for i in self._positions]

    @property
    def stage(self) -> int:
        return self._zero.stage

    @property
    def grads_are_sharded(self) -> bool:
        return self._zero.grads_are_sharded

    @property
    def params_sharded(self) -> bool:
        return self._zero.params_sharded

    @property
    def units(self) -> Sequence[ShardedUnit]:
        return self._zero.units

    def grad_pieces(self) -> list[list[torch.Tensor]]:
        pieces = self._zero.grad_pieces()
        return [pieces[i] for i in self._positions]

    def host_param_bytes(self) -> int:
        return self._zero.host_param_bytes()

    def write_back(self) -> None:
        """The whole stage's: its groups are written back together (PartialMasters does it per side)."""
        self._zero.write_back()


def squared_norm(pieces: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor | None:
    """The sum of squares of every piece (fp32, on the pieces' device); None when there are none."""
    flat = [piece for group in pieces for piece in group]
    if not flat:
        return None
    norms = [torch.linalg.vector_norm(piece, dtype=torch.float32) for piece in flat]
    return torch.stack(norms).square().sum()


class PartialMasters:
    """The device's groups updated by the device's optimizer step, the host's by `HostMasters`."""

    def __init__(
        self,
        groups: Sequence[FlatGroup],
        zero: ZeroStage,
        device: torch.device,
        *,
        split: OffloadSplit,
        host: Any,
    ) -> None:
        """`host`: the front door's `HostMasters` over `host_view(zero, split)` (runtime.offload), the
        placement of the host's groups; this one adds the device's groups and the shared norm."""
        if not split.partial:
            raise ValueError(
                f"PartialMasters needs groups on both sides, got host {split.host}, device {split.device}"
            )
        self.groups = list(groups)
        self.split = split
        self.host: Any = host  # HostMasters (the front door alone names it)
        self.target = host.target  # the stage's working weights: the device side publishes there too
        self.device_groups = [self.groups[i] for i in split.device]
        for group in self.device_groups:
            if group.master.device != device:  # stage 3's parameter offload built it beside its host shard
                group.master = nn.Parameter(group.master.detach().to(device), requires_grad=True)
                group.master_is_alias = False  # write_back copies it into the (host) working shard
        self._device = DeviceMasters(self.device_groups, StageView(zero, split.device))
        self._host_stage = StageView(zero, split.host)
        self._total: torch.Tensor | None = None  # this step's squared norm over both sides and all ranks

    # -- delegated to the host side (bind: to both sides) ----------------------------------------------
    def bind(self, optimizer: torch.optim.Optimizer | None) -> None:
        self._device.bind(optimizer)  # the device's groups: their Adam state now, as without offload
        self.host.bind(optimizer)

    def prepare_step(self, optimizer: torch.optim.Optimizer, math: GradMath, *, per_tensor: bool) -> None:
        self.host.prepare_step(optimizer, self._host_math(math), per_tensor=per_tensor)

    def begin_backward(self, *, boundary: bool) -> None:
        self.host.begin_backward(boundary=boundary)

    def run_backward(self, backward: Callable[[], None]) -> None:
        self.host.run_backward(backward)

    def end_backward(self, *, boundary: bool) -> None:
        self.host.end_backward(boundary=boundary)

    @property
    def update_on_device(self) -> bool:
        """Whether the host side's Adam step streams its state through the device (update_site.py)."""
        return self.host.update_on_device

    def host_bytes(self, optimizer: torch.optim.Optimizer | None) -> tuple[int, int]:
        return self.host.host_bytes(optimizer)

    def device_buffer_bytes(self) -> int:
        return self.host.device_buffer_bytes()

    def flush(self) -> None:
        self.host.flush()  # the device side has nothing in flight after its step

    def close(self) -> None:
        self.host.close()

    def delay_updates(self, after_steps: int) -> None:
        raise ValueError(
            f"the delayed parameter update needs all of the optimizer on the host, and {RATIO_KEY} is "
            f"{self.split.ratio:g}: the host's share would be updated from gradients one step stale while "
            "the device's share is current. Set the ratio to 1.0, or train without the delayed update"
        )

    # -- the step --------------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, math: GradMath, *, per_tensor: bool) -> GradResult:
        """The device side's norm (with the host's squares in it), clip and update queued first, then the
        host side's step with the same norm."""
        self._total = None
        host_pieces = self._host_stage.grad_pieces()

        def reduce_both(squared: torch.Tensor) -> None:
            host_squared = squared_norm(host_pieces)
            if host_squared is not None:  # host-side gradient shards may live in host memory
                squared.add_(host_squared.to(squared.device))
            if math.all_reduce_sum is not None:
                math.all_reduce_sum(squared)
            self._total = squared.clone()

        # the device side is DeviceMasters over its groups: the host's masters get no grad, so torch's step
        # skips them
        device_math = replace(math, all_reduce_sum=reduce_both)
        result = self._device.step(optimizer, device_math, per_tensor=per_tensor)
        host_result = self.host.step(optimizer, self._host_math(math), per_tensor=per_tensor)
        if host_result.overflow != result.overflow:  # one norm decides both: a mismatch is a bug here
            raise AssertionError(
                f"overflow decided differently: device {result.overflow}, host {host_result.overflow}"
            )
        return result

    def _host_math(self, math: GradMath) -> GradMath:
        """The host side's arithmetic: its norm reduction takes the total the device side computed."""

        def agreed_total(squared: torch.Tensor) -> None:
            if self._total is None:
                raise AssertionError("the host side needs the step's norm before the device side computed it")
            squared.copy_(self._total)

        return replace(math, all_reduce_sum=agreed_total)

    def write_back(self) -> None:
        """The device side's masters into the working weights (published like the host side's pieces), then
        the host side's uploads and publications."""
        pending: list[Pending] = []
        with torch.no_grad():
            for group in self.device_groups:
                for bucket in group.layout.buckets:
                    if not group.master_is_alias:
                        self.target.piece(group, bucket.index).copy_(group.master_piece(bucket))
                    published = self.target.publish(group, bucket.index)
                    if published is not None:
                        pending.append(published)
        self.host.write_back()
        for published in pending:
            published.wait()


def host_view(zero: ZeroStage, split: OffloadSplit) -> StageView:
    """The stage as the host side's `HostMasters` sees it: only the host's groups."""
    return StageView(zero, split.host)


def log_split(split: OffloadSplit, groups: Sequence[FlatGroup], comm: Comm) -> None:
    """Say once (rank 0) where the optimizer state went and how close the share came to the ratio."""
    if comm.rank != 0:
        return

    def shard(group: FlatGroup) -> int:  # this rank's parameter elements, without the alignment padding
        return sum(piece.numel for piece in group.layout.param_pieces(group.rank))

    host = sum(shard(groups[i]) for i in split.host)
    device = sum(shard(groups[i]) for i in split.device)
    _log.info("offload: %s", describe_split(split, host, device))
