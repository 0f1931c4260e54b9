"""Where an offloaded step puts the updated weights on the device, per ZeRO stage.

After the host has updated this rank's piece of a bucket, the low-precision result is copied into the
device buffer the stage reads its weights from, and then *published*: made visible to the model.

- `ReplicatedWorking` (stages 1 and 2, and every stage with one rank): the piece lives inside the full
  working buffer the parameters are views of; with several ranks each bucket is all-gathered in place as
  soon as this rank's piece is back, while the host goes on with the next bucket.
- `ShardedWorking` (stage 3 with several ranks): the piece is the unit's resident working shard
  (`Segment.shard`); a persistent unit is re-gathered right away, the others gather at their next use.
  With parameter offload (`offload_param: {device: cpu}`) the shard lives in host memory (pinned with
  CUDA): `piece` returns it, the host step writes the new weights straight into it (`on_host`), and
  each gather uploads the shard before its all-gather (`Segment.gather_source`).

`Publisher` is the way every updated span takes to the model: its writes (the device step's kernels, the
host's uploads) are waited for on the compute stream, then its bucket is published; `wait_*` end all of
it before the next forward (the placement's `write_back`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from runtime.comm import Comm, Pending
from runtime.offload.io.copies import CopyEngine, Ticket
from runtime.offload.io.spans import Span
from runtime.zero import StageGroups
from runtime.zero.flat import FlatGroup
from runtime.zero.stage3_unit import Segment, ShardedUnit


class WorkingTarget(Protocol):
    on_host: bool  # pieces are host memory: the host step may write its output straight into them

    def piece(self, group: FlatGroup, bucket: int) -> torch.Tensor:
        """The tensor that receives this rank's updated piece of `bucket` (shard order): on the device,
        or in host memory when `on_host`."""
        ...

    def host_bytes(self) -> int:
        """Working-weight bytes the target keeps in host memory."""
        ...

    def publish(self, group: FlatGroup, bucket: int) -> Pending | None:
        """Start making the updated piece visible to the model (after it was written); None if nothing
        is needed."""
        ...


class ReplicatedWorking:
    """Stages 1 and 2: pieces inside the full working buffer, all-gathered with more than one rank."""

    on_host = False

    def __init__(self, comm: Comm, *, gather: bool) -> None:
        self.comm = comm
        self.gather = gather

    def host_bytes(self) -> int:
        return 0

    def piece(self, group: FlatGroup, bucket: int) -> torch.Tensor:
        return group.piece(group.working, group.layout.buckets[bucket])

    def publish(self, group: FlatGroup, bucket: int) -> Pending | None:
        if not self.gather:
            return None
        spec = group.layout.buckets[bucket]
        full = group.bucket_view(group.working, spec)
        return self.comm.all_gather(full, group.piece(group.working, spec), async_op=True)


class ShardedWorking:
    """Stage 3 with several ranks: pieces are the units' working shards (one bucket per segment)."""

    def __init__(self, zero: StageGroups, comm: Comm) -> None:
        self.comm = comm
        self.zero = zero
        self._segment: dict[int, tuple[ShardedUnit, Segment]] = {}
        for unit in zero.units:
            for segment in unit.segments:
                self._segment[id(segment.group)] = (unit, segment)
        self.on_host = any(s.offloaded for _, s in self._segment.values())

    def host_bytes(self) -> int:
        return self.zero.host_param_bytes()

    def piece(self, group: FlatGroup, bucket: int) -> torch.Tensor:
        _, segment = self._segment[id(group)]
        spec = group.layout.buckets[bucket]
        return segment.shard.narrow(0, spec.shard_offset, spec.piece_numel)

    def publish(self, group: FlatGroup, bucket: int) -> Pending | None:
        unit, segment = self._segment[id(group)]
        if not unit.persistent or bucket != len(group.layout.buckets) - 1:
            return None
        return unit.regather(segment)  # uploads an offloaded shard first


def working_target(zero: StageGroups, comm: Comm) -> WorkingTarget:
    """The target for the stage `zero`: sharded working weights (stage 3) or a full working buffer."""
    if zero.params_sharded:  # stage 3 with several ranks, or with offload_param
        return ShardedWorking(zero, comm)
    return ReplicatedWorking(comm, gather=zero.stage in (1, 2) and comm.world_size > 1)


class Publisher:
    """Updated spans into the working weights: the pieces they are written to, and their publishing."""

    def __init__(self, groups: Sequence[FlatGroup], target: WorkingTarget, copies: CopyEngine) -> None:
        self.groups = groups
        self.target = target
        self.copies = copies
        self._published: list[Pending] = []
        self._last_upload: Ticket = None  # the last upload of a span the host updated

    def piece(self, span: Span) -> torch.Tensor:
        """Where `span`'s updated weights go (`WorkingTarget.piece`)."""
        return self.target.piece(self.groups[span.group], span.bucket)

    def note_upload(self, written: tuple[Ticket, Ticket]) -> None:
        """Remember the last upload of the host's updates (`written`: a span's head and tail tickets): the
        copies' upload stream runs in order, so waiting for it covers every earlier one (the device's
        writes are covered by the device step's own wait)."""
        if written[1] is not None:
            self._last_upload = written[1]

    def uploaded(self, span: Span, ticket: Ticket) -> None:
        """The host queued `span`'s whole upload (`ticket`): note it and publish the span."""
        if ticket is not None:  # an empty span queues no copy: the last one still stands
            self._last_upload = ticket
        self.publish(span, (None, ticket))

    def publish(self, span: Span, written: tuple[Ticket, Ticket]) -> None:
        """Publish the span's bucket (all-gather it, for stages 1 and 2) once its new weights, written
        when both tickets are done, are in place (None: they are)."""
        for ticket in written:
            self.copies.device_wait(ticket)
        pending = self.target.publish(self.groups[span.group], span.bucket)
        if pending is not None:
            self._published.append(pending)

    def wait_uploads(self) -> None:
        """The compute stream waits for the last upload (the host does not wait)."""
        self.copies.device_wait(self._last_upload)

    def wait_published(self) -> None:
        """Wait for every publishing started (the all-gathers)."""
        published, self._published = self._published, []
        for pending in published:
            pending.wait()
