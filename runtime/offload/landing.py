"""Gradients landing on the host: one device-to-host copy per span, as soon as its bucket is final.

A span (spans.py) is this rank's piece of one bucket. `GradLanding` owns the host buffers the spans land
in, the copy of each span (its `Ticket`), and when it starts:

- streaming (one rank, stages 1 and 2, copies that do not block autograd): a post-accumulate-grad hook
  per parameter feeds a `BucketTracker`, and a bucket's copy starts, on its own CUDA stream, as soon as
  backward has finished its last parameter, while backward goes on;
- otherwise (more ranks, or the sharded stage 3 whose gradients arrive by reduce-scatter) every span
  lands at the end of the boundary backward, after the ZeRO stage has reduced it.

One copy per bucket, never one per parameter. The buffers are pinned where a copy engine reads them.
When the GPU runs the step (device_step.py) nothing crosses: a span "lands" when its gradients are final,
its `finals` ticket marks that point on the device, and there are no buffers. When the GPU and the CPU
share the step (`parts`: the tail of each span that the CPU updates) only the tails cross, into buffers
that hold just them.

What lands (`choose_landing`, set with `offload_optimizer.grad_transfer`: auto, fp32 or native): by default,
on a GPU, 16-bit gradients of fp32 masters are converted to fp32 on the device, a transfer chunk at a
time, and land as fp32 whenever host memory holds the 16 bytes a parameter that costs (fp32 master, two
Adam moments, the fp32 landing buffer) on every rank (`agree_on_landing`); the host step is then
torch's fused fp32 kernel alone. Otherwise, with `native`, and always with `offload_param` (whose
kernel writes the new 16-bit weights on the host), they land in their own dtype (2 bytes a parameter)
and the host step converts them in cache (14 bytes a parameter).
On the H200 GPT-2 XL's whole offloaded step was 1.15-1.31x faster with fp32 landing in three runs
(0.634 s against 0.758 s in the one BENCHMARKS.md tabulates), although it moves twice the bytes over
PCIe: the host's memory bandwidth, which the copies and the update share, limits the step, and the
fused kernel makes the fewest passes over host memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from runtime.comm import Comm
from runtime.distributed import local_world_size
from runtime.memory import host_available_bytes
from runtime.offload.copies import CopyEngine, Ticket
from runtime.offload.host_memory import HostMemory
from runtime.offload.spans import Span, packed_offsets, piece_containing, plan_chunks
from runtime.zero.buckets import BucketTracker
from runtime.zero.flat import FlatGroup

KEY = "offload_optimizer.grad_transfer"  # how the reasons name the setting
FP32_LANDING_HOST_BYTES = 16  # per parameter of the shard: master 4 + exp_avg 4 + exp_avg_sq 4 + landing 4
FP32_LANDING_HEADROOM = 4 << 30  # per rank, what the rest of the process keeps under "auto" (CUDA context,
# pinned staging, checkpoint buffers), as the offload bench's own host guard assumes


@dataclass(frozen=True)
class LandingChoice:
    """The dtype gradients land on the host in, and why (the engine logs it at startup)."""

    dtype: torch.dtype
    reason: str


def choose_landing(
    grad_dtype: torch.dtype,
    master_dtype: torch.dtype,
    *,
    setting: str | None = None,
    on_gpu: bool,
    weights_on_host: bool,
    shard_numel: int,
    local_ranks: int,
    host_available: int,
) -> LandingChoice:
    """Whether 16-bit gradients land as fp32 (see the module docstring). `setting` is the key's value
    (None: auto); `host_available` the host's available bytes, shared by `local_ranks` ranks like this one."""
    if setting not in (None, "fp32", "native"):
        raise ValueError(f"{KEY} {setting!r}: expected 'fp32', 'native' or None (auto)")
    if grad_dtype == master_dtype:
        return LandingChoice(grad_dtype, f"gradients land as {_name(grad_dtype)}, the master's dtype")
    if master_dtype != torch.float32:  # the fused fp32 kernel is what fp32 landing buys
        return LandingChoice(grad_dtype, f"gradients land as {_name(grad_dtype)}: the master is not fp32")
    native = _name(grad_dtype)
    if weights_on_host:  # the kernel writes the new 16-bit weights straight into the offloaded shard
        return LandingChoice(grad_dtype, f"gradients land as {native}: offload_param updates on the host")
    if setting == "native":
        return LandingChoice(grad_dtype, f'gradients land as {native} ({KEY}: "native")')
    if setting == "fp32":
        return LandingChoice(torch.float32, f'gradients land as fp32 ({KEY}: "fp32")')
    if not on_gpu:
        return LandingChoice(grad_dtype, f"gradients land as {native}: no PCIe to trade bytes on")
    need = (shard_numel * FP32_LANDING_HOST_BYTES + FP32_LANDING_HEADROOM) * local_ranks
    gib = 1 << 30
    if host_available < need:
        return LandingChoice(
            grad_dtype,
            f"gradients land as {native} (14 host bytes a parameter): fp32 landing, the faster host step, "
            f"needs {need / gib:.1f} GiB for {local_ranks} rank(s) here and {host_available / gib:.1f} GiB "
            "is available",
        )
    return LandingChoice(
        torch.float32,
        f"gradients land as fp32: 16 host bytes a parameter ({need / gib:.1f} GiB for {local_ranks} "
        f"rank(s) here, of {host_available / gib:.1f} GiB available) buy the fused host step; "
        f'{KEY}: "native" keeps 14',
    )


def landing_choice(
    grad_dtype: torch.dtype,
    master_dtype: torch.dtype,
    *,
    setting: str | None,
    on_gpu: bool,
    weights_on_host: bool,
    shard_numel: int,
) -> LandingChoice:
    """`choose_landing` with the host memory left to this process (a container's limit included) and
    the number of ranks on this host read here."""
    return choose_landing(
        grad_dtype,
        master_dtype,
        setting=setting,
        on_gpu=on_gpu,
        weights_on_host=weights_on_host,
        shard_numel=shard_numel,
        local_ranks=local_world_size(),
        host_available=host_available_bytes(),
    )


def agree_on_landing(
    choice: LandingChoice, grad_dtype: torch.dtype, comm: Comm, device: torch.device
) -> LandingChoice:
    """The landing every rank uses: fp32 only where all ranks chose it. Each rank chose from its own
    reading of its host's memory, and ranks that read it later see what earlier ones allocated; one
    rank landing bf16 would set the pace of all of them anyway."""
    wide = comm.count(choice.dtype != grad_dtype, device)
    if wide in (0, comm.world_size):
        return choice
    return LandingChoice(
        grad_dtype,
        f"gradients land as {_name(grad_dtype)}: {comm.world_size - wide} of {comm.world_size} ranks have "
        "no room for fp32 landing on their host",
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
