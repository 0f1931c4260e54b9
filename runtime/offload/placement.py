"""Where the optimizer's master weights live, as one part the engine composes: on the device or on the host.

The engine's step talks to a `MasterPlacement` and never asks where the state is:

    prepare_step(optimizer, math)                       # before the boundary backward
    begin_backward(boundary) / end_backward(boundary)   # around autograd (gradients may start moving)
    run_backward(backward)                              # autograd itself
    step(optimizer, math, per_tensor) -> GradResult     # norm, overflow, clip, optimizer update
    write_back()                                        # updated weights into the working buffers
    flush()                                             # nothing in flight (before reading the masters)

`DeviceMasters` is the plain case (the masters sit next to the gradients: fp32 master gradients, then
`finish_grads`, then `optimizer.step()`, then the ZeRO stage writes back and all-gathers).
`HostMasters` (host_masters.py) is `offload_optimizer: {device: cpu}`, and `PartialMasters` (partial.py)
that with a `ratio` below 1 (some groups on each side); the package's front door
(`runtime.offload.build_master_placement`) picks one. This module imports nothing from runtime/offload,
so every other part of it may import this one.

Each `step` gets the engine's `GradMath` (runtime/precision/grad_math.py: how many ranks and micro-steps
the sums span, the loss scale, the clipping norm, whether a norm is needed at all) and applies it
wherever its gradients are.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from runtime.precision.adam_state import make_adam_state, unsupported_reason
from runtime.precision.fused_master import (
    KERNEL_FAILED,
    FusedMasterAdam,
    Segment,
    compile_refusal,
    default_refusal,
    fused_setting,
    plan_runs,
)
from runtime.precision.grad_math import (
    GradMath,
    GradResult,
    device_grad_verdict,
    finish_grads,
    master_grads_from,
)
from runtime.zero import StageGroups
from runtime.zero.flat import FlatGroup

_log = logging.getLogger(__name__)


class MasterPlacement(Protocol):
    def bind(self, optimizer: torch.optim.Optimizer | None) -> None:
        """The engine built `optimizer` over the masters (it decides, for instance, whether an offloaded
        step can run on the device)."""
        ...

    def prepare_step(self, optimizer: torch.optim.Optimizer, math: GradMath, *, per_tensor: bool) -> None:
        """Before the boundary backward, with the arithmetic `step` will get: a placement that can update
        while gradients arrive starts here."""
        ...

    def begin_backward(self, *, boundary: bool) -> None: ...

    def run_backward(self, backward: Callable[[], None]) -> None:
        """Run `backward` (autograd) between begin_backward and end_backward."""
        ...

    def end_backward(self, *, boundary: bool) -> None: ...

    def step(self, optimizer: torch.optim.Optimizer, math: GradMath, *, per_tensor: bool) -> GradResult:
        """Average, unscale and clip this rank's gradients and update its master shard; on overflow
        nothing is updated."""
        ...

    def write_back(self) -> None:
        """Make the updated weights the working weights (all-gathered where the stage needs it)."""
        ...

    def host_bytes(self, optimizer: torch.optim.Optimizer | None) -> tuple[int, int]:
        """(master + optimizer state bytes in host memory, host staging buffer bytes)."""
        ...

    def device_buffer_bytes(self) -> int:
        """Staging buffers on the training device (the offloaded step's, when the GPU runs it)."""
        ...

    def flush(self) -> None:
        """Finish any update still in flight, so the masters, the optimizer state and the working weights
        agree (before a checkpoint or a full state dict reads them)."""
        ...

    def close(self) -> None: ...


def attach_master_grads(
    optimizer: torch.optim.Optimizer,
    groups: Sequence[FlatGroup],
    grads: Sequence[torch.Tensor] | None,
    *,
    per_tensor: bool,
) -> None:
    """Point the optimizer's parameters (one flat master per group, or one view per parameter) at the
    master gradients, or detach them (`grads=None`). `groups` may be a subset of the stage's (partial
    offload): a group's optimizer param group is the one at `group.index`."""
    for index, group in enumerate(groups):
        grad = None if grads is None else grads[index]
        if not per_tensor:
            group.master.grad = grad
            continue
        views = optimizer.param_groups[group.index]["params"]
        for view, slot in zip(views, group.layout.slots, strict=True):
            view.grad = None if grad is None else grad.narrow(0, slot.offset, slot.numel).view(view.shape)


def group_segments(
    group: FlatGroup, pieces: Sequence[torch.Tensor], shard: torch.Tensor | None = None
) -> list[Segment]:
    """Matching slices of `group`'s master, its reduced gradient `pieces` (master order) and its working
    buffer, one per contiguous run; with `shard` (ZeRO-3: this rank's working shard, laid out like the
    master), that shard whole; empty when the pieces do not line up with the master."""
    master, working, layout = group.master.data, group.working, group.layout
    if shard is not None:
        if len(pieces) != 1 or not pieces[0].numel() == shard.numel() == master.numel():
            return []
        return [Segment(master, (pieces[0].view(-1),), shard, 0)] if master.numel() else []
    if layout.shard_is_contiguous:
        start, end = layout.shard_range(group.rank)
        numels = [p.numel() for p in pieces]
        if sum(numels) != master.numel() or end - start != master.numel():
            return []
        starts = [0, *itertools.accumulate(numels)]
        out = []
        for first, last in plan_runs(numels):  # many small pieces: one launch a run, not a piece
            offset, n = starts[first], starts[last] - starts[first]
            joined = tuple(p.view(-1) for p in pieces[first:last] if p.numel())
            out.append(
                Segment(master.narrow(0, offset, n), joined, working.narrow(0, start + offset, n), offset)
            )
        return out
    buckets = layout.buckets
    if len(pieces) == 1:
        flat = pieces[0].view(-1)
        grads = [flat.narrow(0, b.shard_offset, b.piece_numel) for b in buckets]
    elif len(pieces) == len(buckets):
        grads = [p.view(-1) for p in pieces]
    else:
        return []
    return [
        Segment(group.master_piece(b), (g,), group.piece(working, b), b.shard_offset)
        for b, g in zip(buckets, grads, strict=True)
        if b.piece_numel
    ]


class DeviceMasters:
    """Masters on the training device: the optimizer steps them where the gradients are.

    The step: fp32 master gradients, `finish_grads`, the optimizer's own `step()`; or, where it can (fp32
    masters behind 16-bit weights, torch's Adam/AdamW, gradients and weights laid out like the masters; by
    default on CUDA, `DSLAUNCH_FUSED_MASTER_STEP` says otherwise), `FusedMasterAdam`'s one pass, which
    reads the 16-bit gradients and writes the working weights itself (precision/fused_master.py)."""

    def __init__(self, groups: Sequence[FlatGroup], zero: StageGroups) -> None:
        self.groups = list(groups)
        self.zero = zero
        self._fused_setting = fused_setting()
        self._fused: FusedMasterAdam | None = None
        self._fused_decided = False
        # ZeRO-3 with sharded weights: each group's working shard (what its fused step writes)
        self._shards = {id(seg.group): seg.shard for unit in zero.units for seg in unit.segments}

    def bind(self, optimizer: torch.optim.Optimizer | None) -> None:
        self._fused, self._fused_decided = None, False  # decided at the first step, on its gradients
        if optimizer is not None:  # torch's Adam state now, in the layout the fused step takes as it is
            make_adam_state(
                optimizer, [group.master for group in self.groups], [g.index for g in self.groups]
            )

    def prepare_step(self, optimizer: torch.optim.Optimizer, math: GradMath, *, per_tensor: bool) -> None:
        pass

    def begin_backward(self, *, boundary: bool) -> None:
        pass

    def run_backward(self, backward: Callable[[], None]) -> None:
        backward()

    def end_backward(self, *, boundary: bool) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer, math: GradMath, *, per_tensor: bool) -> GradResult:
        pieces = self.zero.grad_pieces()
        segments = self._fused_segments(optimizer, pieces)
        if segments is not None:
            assert self._fused is not None
            norm, finite, factor = device_grad_verdict([p for group in pieces for p in group], math)
            # the kernels skip a non-finite step themselves, so they are launched before the verdict is
            # read: the host sync then waits for the step instead of the GPU waiting for its launches
            self._fused.step(optimizer, segments, factor, keep=finite)
            overflow = finite is not None and not bool(finite)
            for group in self.groups:  # skipped, the kernels wrote the weights they found: no write-back runs
                group.working_written = not overflow
            return GradResult(norm, overflow)
        grads = master_grads_from(pieces, [group.master for group in self.groups])
        result = finish_grads(grads, math)
        if result.overflow:
            return result
        attach_master_grads(optimizer, self.groups, grads, per_tensor=per_tensor)
        optimizer.step()
        attach_master_grads(optimizer, self.groups, None, per_tensor=per_tensor)
        return result

    def _fused_segments(
        self, optimizer: torch.optim.Optimizer, pieces: list[list[torch.Tensor]]
    ) -> list[list[Segment]] | None:
        """This step's segments for the fused step, or None when the optimizer's own step runs."""
        if not self._fused_decided:
            self._fused_decided = True
            why = self._fused_refusal(optimizer, pieces)
            if why is None:
                self._fused = FusedMasterAdam(
                    [group.master for group in self.groups], [group.index for group in self.groups]
                )
                _log.info("optimizer step: one fused pass (16-bit gradients in, 16-bit weights out)")
            elif self._fused_setting:
                _log.warning("DSLAUNCH_FUSED_MASTER_STEP=1 ignored: %s", why)
            elif why.startswith(KERNEL_FAILED):  # the default's probe failed: say so, it costs speed
                _log.warning("the fused optimizer step is off, torch's own runs: %s", why)
            else:
                _log.debug("optimizer step: torch's own (%s)", why)
        if self._fused is None:
            return None
        return [
            group_segments(group, group_pieces, self._shards.get(id(group)))
            for group, group_pieces in zip(self.groups, pieces, strict=True)
        ]

    def _fused_refusal(
        self, optimizer: torch.optim.Optimizer, pieces: list[list[torch.Tensor]]
    ) -> str | None:
        if self._fused_setting is False:
            return "DSLAUNCH_FUSED_MASTER_STEP=0"
        if not self.groups:
            return "no groups"
        device = self.groups[0].master.device
        if self._fused_setting is None and (why := default_refusal(device)) is not None:
            return why
        if self.zero.params_sharded and any(
            self._shards.get(id(group)) is None or self._shards[id(group)].device != device
            for group in self.groups
        ):
            return "the working shards are not beside the masters (offload_param keeps them in host memory)"
        if any(group.index >= len(optimizer.param_groups) for group in self.groups):
            return "the optimizer's param groups are not the flat groups"
        why = unsupported_reason(optimizer)
        if why is not None:
            return why
        for group, group_pieces in zip(self.groups, pieces, strict=True):
            if group.master_is_alias or group.master.dtype != torch.float32:
                return "the masters are not an fp32 copy"
            if group.working.dtype not in (torch.bfloat16, torch.float16) or group.master.device != device:
                return "the working weights are not 16-bit on the masters' device"
            if any(p.dtype != group.working.dtype or p.device != device for p in group_pieces):
                return "the gradients are not in the working dtype"
            if not group_segments(group, group_pieces, self._shards.get(id(group))) and group.master.numel():
                return "the gradients are not laid out like the masters"
        return compile_refusal(device, self.groups[0].working.dtype)

    def write_back(self) -> None:
        self.zero.write_back()

    def host_bytes(self, optimizer: torch.optim.Optimizer | None) -> tuple[int, int]:
        return self.zero.host_param_bytes(), 0  # working shards under offload_param (no optimizer's offload)

    def device_buffer_bytes(self) -> int:
        return 0

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
