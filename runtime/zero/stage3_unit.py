"""One ZeRO-3 gather unit: its flat buffers, its state, and the verbs gather / release / write back.

A unit (see stage3_plan) holds one *segment* per optimizer param group it has parameters of. A segment is
an engine-visible `FlatGroup` laid out as a single bucket, so rank r's shard is the r-th contiguous
1/N of the flat buffer and one all-gather per segment rebuilds it in place. Per segment a rank keeps:

- `shard`: its piece of the working weights (param_dtype), always resident: on the device, or in host
  memory under `offload_param` (`offloaded`; pinned with CUDA), uploaded into the working buffer's own
  chunk before each all-gather;
- `group.master`: its fp32 master piece (the optimizer's tensor; the shard itself when dtypes agree, and
  always in an engine without an optimizer);
- `grad_shard`: its piece of the reduced gradients (0 elements in an engine without an optimizer);
- `group.working`: the full working buffer, whose *storage* is resized to 0 bytes while the unit is
  released and re-allocated to full size for a gather. Parameters are views into it while gathered.

[Note: why release resizes storage instead of dropping the buffer] Autograd saves views of parameters
(`weight.t()` inside linear) that point at the working storage. Keeping the same storage object and
refilling it before backward keeps those saved views valid; dropping the buffer would leave them pointing
at freed memory. Parameters themselves switch to a memory-less placeholder (stage3_param.release).

States move SHARDED -> GATHERING (all-gather launched) -> GATHERED (waited, parameters materialized) ->
SHARDED (released). `GatherStats` counts live gathered bytes so tests and logs can check the limits.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from runtime.comm import Comm, Pending
from runtime.host_memory import HostMemory
from runtime.zero import stage3_param
from runtime.zero.flat import FlatGroup
from runtime.zero.partition import ALIGN_ELEMENTS, plan_flat_layout
from runtime.zero.stage3_plan import UnitPlan
from runtime.zero.stage3_upload import ShardUploads


class UnitState(enum.Enum):
    SHARDED = "sharded"  # only this rank's shards exist; the unit's parameters are released
    GATHERING = "gathering"  # all-gathers into the working buffers are in flight
    GATHERED = "gathered"  # working buffers hold the full weights; parameters are views into them


@dataclass
class GatherStats:
    """Bytes and elements of working weights gathered right now, their peak, and event counts."""

    live_bytes: int = 0
    live_numel: int = 0
    peak_bytes: int = 0
    peak_numel: int = 0
    gathers: int = 0
    releases: int = 0

    def add(self, nbytes: int, numel: int) -> None:
        self.live_bytes += nbytes
        self.live_numel += numel
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.peak_numel = max(self.peak_numel, self.live_numel)

    def reset_peak(self) -> None:
        self.peak_bytes, self.peak_numel = self.live_bytes, self.live_numel


@dataclass
class Segment:
    """The part of a unit that belongs to one optimizer param group."""

    group: FlatGroup
    shard: torch.Tensor  # 1-D, param_dtype, layout.shard_numel: this rank's working weights
    views: list[torch.Tensor]  # param-shaped views of group.working, one per parameter
    grad_shard: torch.Tensor  # 1-D, param_dtype: this rank's reduced gradients (on the device)
    offloaded: bool = False  # `shard` lives in host memory (offload_param); gathers upload it first

    def gather_source(self) -> torch.Tensor:
        """What this rank contributes to the segment's all-gather: the shard itself, or, when it lives in
        host memory, this rank's chunk of the (allocated) working buffer after uploading the shard there.
        The upload is queued on the current stream, so the all-gather that follows sees it."""
        if not self.offloaded:
            return self.shard
        group = self.group
        piece = group.layout.shard_numel
        mine = group.working.narrow(0, group.rank * piece, piece)
        mine.copy_(self.shard, non_blocking=self.shard.is_pinned())
        return mine

    @property
    def numel(self) -> int:
        return self.group.layout.numel

    @property
    def nbytes(self) -> int:
        return self.group.layout.numel * self.group.working.element_size()


def build_segment(
    index: int,
    spec_index: int,
    params: Sequence[nn.Parameter],
    values: Sequence[torch.Tensor],
    options: dict[str, Any],
    *,
    names: Sequence[str],
    comm: Comm,
    param_dtype: torch.dtype,
    master_dtype: torch.dtype,
    device: torch.device,
    host: HostMemory | None = None,
    align: int = ALIGN_ELEMENTS,
    grads: bool = True,
) -> Segment:
    """Shard one segment: keep this rank's piece of `values` (full parameter values, any dtype) as the
    working shard and the master, and make an empty full-size working buffer with parameter views.
    With `host` (a runtime.host_memory.HostMemory: parameter offload) the master and the working
    shard are built in host memory, the shard pinned where that helps; they alias there only without
    `grads` (an engine without an optimizer: nothing is updated, so the shard is the only copy, and no
    gradient shard is kept either)."""
    world_size, rank = comm.world_size, comm.rank
    layout = plan_flat_layout(
        [p.numel() for p in params], world_size=world_size, bucket_numel=sys.maxsize, align=align
    )
    with torch.no_grad():
        # The master comes from the original values, before the working copy rounds them.
        master_device = torch.device("cpu") if host is not None else device
        master = torch.zeros(layout.shard_numel, dtype=master_dtype, device=master_device)
        for piece in layout.param_pieces(rank):
            source = values[piece.param].reshape(-1).narrow(0, piece.param_offset, piece.numel)
            master.narrow(0, piece.shard_offset, piece.numel).copy_(source)
        alias = master_dtype == param_dtype and (host is None or not grads)
        if host is not None:
            shard = host.empty(layout.shard_numel, param_dtype, pinned=True).copy_(master)
            if alias:
                master = shard
        else:
            shard = master if alias else master.to(param_dtype)
        working = torch.empty(layout.numel, dtype=param_dtype, device=device)
        views = [
            working.narrow(0, slot.offset, slot.numel).view(p.shape)
            for p, slot in zip(params, layout.slots, strict=True)
        ]
        working.untyped_storage().resize_(0)  # [Note: why release resizes storage instead of dropping]
    group = FlatGroup(
        index=index,
        params=list(params),
        options=dict(options),
        layout=layout,
        rank=rank,
        working=working,
        master=nn.Parameter(master, requires_grad=True),
        master_is_alias=alias,
        param_names=list(names),
        spec_index=spec_index,
    )
    grad_shard = torch.zeros(layout.shard_numel if grads else 0, dtype=param_dtype, device=device)
    return Segment(group, shard, views, grad_shard, offloaded=host is not None)


@dataclass
class ShardedUnit:
    """A gather unit with more than one rank (see the module docstring)."""

    plan: UnitPlan
    segments: list[Segment]
    comm: Comm
    stats: GatherStats
    state: UnitState = UnitState.SHARDED
    uploads: ShardUploads | None = None  # offload_param: the uploads' own stream (stage3_upload)
    _pending: list[Pending] = field(default_factory=list)
    _uploaded: Any = None  # the event that ends this gather's uploads (CUDA, offload_param)

    @property
    def index(self) -> int:
        return self.plan.index

    @property
    def persistent(self) -> bool:
        return self.plan.persistent

    @property
    def numel(self) -> int:
        """Elements of the full working buffers (padding included)."""
        return sum(s.numel for s in self.segments)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for s in self.segments for p in s.group.params]

    def start_gather(self) -> None:
        """SHARDED -> GATHERING: allocate the working buffers and launch one all-gather per segment."""
        if self.state is not UnitState.SHARDED:
            return
        for segment in self.segments:  # allocated on the compute stream (stage3_upload says why)
            working = segment.group.working
            working.untyped_storage().resize_(working.numel() * working.element_size())
        if self.uploads is not None and self.host_shard_bytes():
            with self.uploads.side(self.index, self.host_shard_bytes()) as self._uploaded:
                self._launch_gathers()
        else:
            self._launch_gathers()
        self.state = UnitState.GATHERING
        self.stats.gathers += 1
        self.stats.add(self.nbytes, self.numel)

    def _launch_gathers(self) -> None:
        for segment in self.segments:
            working = segment.group.working
            self._pending.append(self.comm.all_gather(working, segment.gather_source(), async_op=True))
            for param in segment.group.params:
                stage3_param.set_ds_attributes(param, ds_status=stage3_param.ZeroParamStatus.INFLIGHT)

    def finish_gather(self) -> None:
        """GATHERING -> GATHERED: wait for the all-gathers and point the parameters at the full weights."""
        if self.state is UnitState.SHARDED:
            self.start_gather()
        if self.state is UnitState.GATHERED:
            return
        pending, self._pending = self._pending, []
        for handle in pending:
            handle.wait()
        uploaded, self._uploaded = self._uploaded, None
        ShardUploads.wait(uploaded)  # compute waits for this unit's uploads only
        for segment in self.segments:
            for param, view in zip(segment.group.params, segment.views, strict=True):
                stage3_param.materialize(param, view)
        self.state = UnitState.GATHERED

    def release(self) -> None:
        """-> SHARDED: drop the full weights (persistent units stay gathered)."""
        if self.persistent or self.state is UnitState.SHARDED:
            return
        if self.state is UnitState.GATHERING:
            self.finish_gather()
        for segment in self.segments:
            for param in segment.group.params:
                stage3_param.release(param)
            segment.group.working.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED
        self.stats.releases += 1
        self.stats.add(-self.nbytes, -self.numel)

    def write_back(self) -> list[Pending]:
        """After an optimizer step: master -> working shard; a persistent unit re-gathers (async)."""
        launched = []
        with torch.no_grad():
            for segment in self.segments:
                group = segment.group
                if group.working_written:  # the fused step wrote the shard as it updated the master
                    group.working_written = False
                elif not group.master_is_alias:
                    segment.shard.copy_(group.master.detach())
                if self.persistent:
                    launched.append(self.regather(segment))
        return launched

    def regather(self, segment: Segment) -> Pending:
        """Re-gather one segment of a gathered (persistent) unit after its shard changed (async)."""
        return self.comm.all_gather(segment.group.working, segment.gather_source(), async_op=True)

    def write_shards_from_working(self, params: set[nn.Parameter] | None = None) -> None:
        """Copy this rank's piece of the gathered working weights into the shard and the master, for
        `params` only (default all), e.g. after they were changed inside GatheredParameters."""
        if self.state is not UnitState.GATHERED:
            raise RuntimeError(f"unit {self.index} is {self.state.value}, not gathered")
        with torch.no_grad():
            for segment in self.segments:
                group = segment.group
                working, master = group.working, group.master.detach()
                for piece in group.layout.param_pieces(group.rank):
                    if params is not None and group.params[piece.param] not in params:
                        continue
                    slot = group.layout.slots[piece.param]
                    source = working.narrow(0, slot.offset + piece.param_offset, piece.numel)
                    segment.shard.narrow(0, piece.shard_offset, piece.numel).copy_(source)
                    if not group.master_is_alias:
                        master.narrow(0, piece.shard_offset, piece.numel).copy_(source)

    def drop_shards(self) -> None:
        """Free this rank's shards, masters and gradient shard for good: another engine took the model over
        (stage3.build_stage3), so they are stale copies of weights that engine now holds. The parameters
        are that engine's, so they are left alone (no `release`); the unit is never gathered again."""
        pending, self._pending = self._pending, []
        for handle in pending:
            handle.wait()
        if self.state is not UnitState.SHARDED:  # persistent units too: nothing of them is kept
            self.stats.add(-self.nbytes, -self.numel)
        for segment in self.segments:
            segment.group.working.untyped_storage().resize_(0)
            segment.shard = segment.grad_shard = segment.shard.new_empty(0)
            segment.group.master = nn.Parameter(segment.group.master.detach().new_empty(0))
        self.state = UnitState.SHARDED

    def working_bytes(self) -> int:
        """Bytes the working buffers really occupy now (storage sizes; 0 when released)."""
        return sum(s.group.working.untyped_storage().nbytes() for s in self.segments)

    def shard_bytes(self) -> int:
        return sum(s.shard.numel() * s.shard.element_size() for s in self.segments)

    def host_shard_bytes(self) -> int:
        """Of `shard_bytes`, the bytes in host memory (parameter offload)."""
        return sum(s.shard.numel() * s.shard.element_size() for s in self.segments if s.offloaded)
