"""Gradients landing on the host: one device-to-host copy per span, as soon as its bucket is final.

A span (spans.py) is this rank's piece of one bucket. `GradLanding` owns the host buffers the spans land
in, the copy of each span (its `Ticket`), and when it starts:

- streaming (one rank, stages 1 and 2, copies that do not block autograd): a post-accumulate-grad hook
  per parameter feeds a `BucketTracker`, and a bucket's copy starts, on its own CUDA stream, as soon as
  backward has finished its last parameter, while backward goes on;
- otherwise (more ranks, or the sharded stage 3 whose gradients arrive by reduce-scatter) every span
  lands at the end of the boundary backward, after the ZeRO stage has reduced it.

One copy per bucket, never one per parameter. The buffers are pinned where a copy engine reads them, in
the gradient dtype (2 bytes a parameter for bf16/fp16), or in fp32 with
`DSLAUNCH_OFFLOAD_GRAD_TRANSFER=fp32` (`landing_dtype`): then the conversion runs on the device, a
transfer chunk at a time, and the host step reads fp32 directly (host_masters.py says what that buys).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from runtime.offload.copies import CopyEngine, Ticket
from runtime.offload.host_memory import HostMemory
from runtime.offload.spans import Span, piece_containing, plan_chunks
from runtime.zero.buckets import BucketTracker
from runtime.zero.flat import FlatGroup

GRAD_TRANSFER_ENV = "DSLAUNCH_OFFLOAD_GRAD_TRANSFER"


def landing_dtype(
    grad_dtype: torch.dtype, master_dtype: torch.dtype, *, weights_on_host: bool
) -> torch.dtype:
    """The dtype gradients land on the host in: their own, or the master's with `GRAD_TRANSFER_ENV=fp32`
    (not with parameter offload, whose updated weights are written on the host)."""
    choice = os.environ.get(GRAD_TRANSFER_ENV, "").strip().lower()
    if choice not in ("", "native", "fp32"):
        raise ValueError(f"{GRAD_TRANSFER_ENV}={choice!r}: expected 'native' (the default) or 'fp32'")
    if choice == "fp32" and master_dtype == torch.float32 and not weights_on_host:
        return torch.float32
    return grad_dtype


class GradLanding:
    """The landing buffers of every group, and the copies of one boundary backward into them."""

    def __init__(
        self,
        groups: Sequence[FlatGroup],
        zero: Any,
        spans: Sequence[Span],
        order: Sequence[tuple[int, int]],
        copies: CopyEngine,
        memory: HostMemory,
        dtype: torch.dtype,
        *,
        stream: bool,
        chunk_elems: int,
    ) -> None:
        self.groups = list(groups)
        self.zero = zero
        self.spans = list(spans)
        self.copies = copies
        self.chunk_elems = chunk_elems
        self.stream = stream  # land during backward, from hooks
        self.buffers = [memory.zeros(g.layout.shard_numel, dtype, pinned=True) for g in self.groups]
        self.tickets: list[Ticket] = []
        self.landed = [False] * len(self.spans)
        self.on_landed: Callable[[int], None] | None = None  # a streamed step's, while one runs
        self._span_at = {(s.group, s.bucket): i for i, s in enumerate(self.spans)}
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
        self._land(self._span_at[(group.index, bucket)])

    def _land(self, index: int) -> None:
        span = self.spans[index]
        dst = self.buffers[span.group].narrow(0, span.shard_offset, span.numel)
        src = self._sources[index]
        if dst.dtype == src.dtype:
            self.tickets[index] = self.copies.to_host(dst, src)
        else:  # converted on the device a chunk at a time, not through a whole-bucket fp32 temporary
            ticket: Ticket = None  # a rank's piece of a bucket can be empty
            for offset, numel in plan_chunks(span.numel, self.chunk_elems):
                ticket = self.copies.to_host(dst.narrow(0, offset, numel), src.narrow(0, offset, numel))
            self.tickets[index] = ticket
        self.landed[index] = True
        if self.on_landed is not None:
            self.on_landed(index)

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers)

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
