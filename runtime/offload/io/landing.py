"""Gradients landing on the host: one device-to-host copy per span, as soon as its bucket is final.

A span (spans.py) is this rank's piece of one bucket. `GradLanding` owns the host buffers the spans land
in, the copy of each span (its `Ticket`), and when it starts:

- streaming (the plan's `stream`: one rank, stages 1 and 2, copies that do not block autograd): a
  post-accumulate-grad hook per parameter feeds a `BucketTracker`, and a bucket's copy starts, on its own
  CUDA stream, as soon as backward has finished its last parameter, while backward goes on;
- otherwise (more ranks, or the sharded stage 3 whose gradients arrive by reduce-scatter) every span
  lands at the end of the boundary backward, after the ZeRO stage has reduced it.

One copy per bucket, never one per parameter. The buffers are pinned where a copy engine reads them.
When the GPU runs the step (step/device_step.py) nothing crosses: a span "lands" when its gradients are
final, its `finals` ticket marks that point on the device, and there are no buffers. When the GPU and
the CPU share the step (`parts`: the tail of each span that the CPU updates) only the tails cross, into
buffers that hold just them.

The dtype they land in is the plan's (plan.py: fp32 or the gradients' own); a dtype other than the
gradients' is converted on the device a transfer chunk at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from runtime.host_memory import HostMemory
from runtime.offload.io.copies import CopyEngine, Ticket
from runtime.offload.io.spans import Span, packed_offsets, piece_containing, plan_chunks
from runtime.zero import StageGroups
from runtime.zero.buckets import BucketTracker
from runtime.zero.flat import FlatGroup


class GradLanding:
    """The landing buffers of every group, and the copies of one boundary backward into them."""

    def __init__(
        self,
        groups: Sequence[FlatGroup],
        zero: StageGroups,
        spans: Sequence[Span],
        order: Sequence[tuple[int, int]],
        copies: CopyEngine,
        memory: HostMemory,
        dtype: torch.dtype,
        *,
        stream: bool,
        chunk_elems: int,
        parts: Sequence[Span] | None = None,
    ) -> None:
        self.groups = list(groups)
        self.zero = zero
        self.spans = list(spans)
        self.copies = copies
        self.chunk_elems = chunk_elems
        self.stream = stream  # land during backward, from hooks
        # what of each span crosses to the host (None: all of it). The rest is updated on the device
        # (device_step.py), which reads its gradients where they are; a span's `finals` ticket marks on
        # the device the point where they are final
        self.parts = list(self.spans if parts is None else parts)
        whole = all(p == s for p, s in zip(self.parts, self.spans, strict=True))
        self.buffers: list[torch.Tensor] = []
        if whole:  # laid out like the shard: the delayed update and the generic step index it so
            self._at = [span.shard_offset for span in self.spans]
            self.buffers = [memory.zeros(g.layout.shard_numel, dtype, pinned=True) for g in self.groups]
        else:
            self._at, lengths = packed_offsets(self.parts, len(self.groups))
            if any(lengths):
                self.buffers = [memory.zeros(n, dtype, pinned=True) for n in lengths]
        self.finals: list[Ticket] = []
        self.tickets: list[Ticket] = []
        self.landed = [False] * len(self.spans)
        self.on_landed: Callable[[int], None] | None = None  # a streamed step's, while one runs
        self._span_at = {(s.group, s.bucket): i for i, s in enumerate(self.spans)}
        # spans name groups by position in `groups`, which is not `group.index` when these are a subset
        # (partial offload: the host's groups only)
        self._position = {id(g): i for i, g in enumerate(self.groups)}
        self._sources: list[torch.Tensor] = []
        self._boundary = False
        self._hooks: list[RemovableHandle] = []
        if stream:
            self.tracker = BucketTracker(self.groups, order, self._land_bucket)
            for group in self.groups:
                for param in group.params:
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad))

    def begin(self, *, boundary: bool) -> None:
        """A backward starts; at the accumulation boundary its gradients will land."""
        self._boundary = boundary
        if boundary:
            self.prepare()
            if self.stream:
                self.tracker.reset()

    def prepare(self) -> None:
        """Find each span's source in the stage's gradient pieces and forget the last landing."""
        pieces = self.zero.grad_pieces()
        self._sources = []
        for span in self.spans:
            group_pieces = pieces[span.group]
            index, offset = piece_containing([p.numel() for p in group_pieces], span.shard_offset, span.numel)
            self._sources.append(group_pieces[index].view(-1).narrow(0, offset, span.numel))
        self.tickets = [None] * len(self.spans)
        self.finals = [None] * len(self.spans)
        self.landed = [False] * len(self.spans)

    def end(self, *, boundary: bool) -> None:
        """Backward is over (and the stage's reductions with it): land what has not landed."""
        if not boundary:
            return
        if self.stream:
            self.tracker.flush()  # buckets whose parameters got no gradient this time
        else:
            self.land_all()
        self._boundary = False

    def land_all(self) -> None:
        for index, landed in enumerate(self.landed):
            if not landed:
                self._land(index)

    def done(self) -> None:
        """The step has consumed this landing."""
        self.landed = [False] * len(self.spans)

    def _on_grad(self, param: nn.Parameter) -> None:
        if self._boundary:
            self.tracker.mark(param)

    def _land_bucket(self, group: FlatGroup, bucket: int) -> None:
        self._land(self._span_at[(self._position[id(group)], bucket)])

    def source(self, index: int) -> torch.Tensor:
        """Span `index`'s gradients on the device (this boundary backward's)."""
        return self._sources[index]

    def landed_grad(self, index: int, buffers: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """The gradients of span `index`'s part on the host, in `buffers` (by default this landing's own;
        the delayed update swaps in others of the same layout)."""
        part = self.parts[index]
        held = self.buffers if buffers is None else buffers
        return held[part.group].narrow(0, self._at[index], part.numel)

    def _land(self, index: int) -> None:
        span, part = self.spans[index], self.parts[index]
        if part.numel < span.numel:  # the device updates the rest, from the gradients where they are
            self.finals[index] = self.copies.mark()
        if part.numel == 0:
            self._landed(index)
            return
        src = self._sources[index].narrow(0, part.shard_offset - span.shard_offset, part.numel)
        dst = self.landed_grad(index)
        if dst.dtype == src.dtype:
            self.tickets[index] = self.copies.to_host(dst, src)
        else:  # converted on the device a chunk at a time, not through a whole-bucket fp32 temporary
            ticket: Ticket = None  # a rank's piece of a bucket can be empty
            for offset, numel in plan_chunks(src.numel(), self.chunk_elems):
                ticket = self.copies.to_host(dst.narrow(0, offset, numel), src.narrow(0, offset, numel))
            self.tickets[index] = ticket
        self._landed(index)

    def _landed(self, index: int) -> None:
        self.landed[index] = True
        if self.on_landed is not None:
            self.on_landed(index)

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers)

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
