"""The offloaded Adam step run by the GPU: the state stays in host memory and streams through the device.

Per chunk of a span the master and both moments go up (12 bytes a parameter), the GPU's fused kernel
updates them from the gradient that never left the device and writes the new working weights in place,
and the three go back down (12 bytes). Whether this step runs, and which share of each span the CPU
takes instead, is the plan's choice (runtime/offload/plan.py).

A `DeviceStep` owns the slots and three CUDA streams: `up` (host to slots), `math` (gradient into fp32,
Adam, new working weights) and `down` (slots to host). Each chunk's upload waits until the slot's last
download is done; its math waits for the upload and for the span's gradients to be final (the span's
ticket, recorded on the compute stream when its bucket was done); its download waits for the math. The
host never waits: it only queues, so the streamed step's calling thread keeps up with autograd. The
host copies of the state are up to date once `host_ready` has waited for the last download; everything
that reads them (a checkpoint, the host path, `state_dict`) goes through `HostMasters.flush` first.

The slots: as many as the caller asks for, or (None) as many as 1/16 of the device's free memory holds,
from 4 to 16 (plan.device_slots).

Between steps: the forward waits only for the last chunk's math, not for the downloads, so a step's
last downloads run during the next forward, as far as the slots reach (`device_slots`). Queuing the next
step's first uploads there too made no difference on the H200 (BENCHMARKS.md), so uploads start when
backward hands over each span.

On a CPU-only machine the "device" is host memory and every copy happens at once: the same chunks, slots
and kernel calls run in order, which is what the tests on gloo check against plain PyTorch.
"""

from __future__ import annotations

import contextlib
import math

import torch

from runtime.config.offload import DEVICE_CHUNK_ELEMS
from runtime.host_memory import HostMemory
from runtime.offload.io.copies import Ticket
from runtime.offload.io.spans import CHUNK_ALIGN, Span, plan_chunks
from runtime.offload.plan import DEVICE_SLOTS, device_slots
from runtime.offload.step.host_adam import HostAdam
from runtime.ops.adam_step import AdamHyperparams
from runtime.zero.partition import align_up


class DeviceStep:
    """Staging slots on the device and the streams that move state through them."""

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        *,
        chunk_elems: int | None = None,
        slots: int | None = None,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.chunk_elems = chunk_elems = DEVICE_CHUNK_ELEMS if chunk_elems is None else chunk_elems
        self.is_async = device.type == "cuda"
        if slots is None and self.is_async:
            slots = device_slots(torch.cuda.mem_get_info(device)[0], chunk_elems)
        slots = DEVICE_SLOTS if slots is None else slots
        width = align_up(chunk_elems, CHUNK_ALIGN)  # plan_chunks rounds a chunk up to that
        # allocated now, so a device without room fails here, at setup, not in the middle of a step
        self._slots = [torch.empty(4, width, dtype=dtype, device=device) for _ in range(slots)]
        self._free: list[Ticket] = [None] * slots  # each slot's last download
        # each chunk's last download, by the address of its host master: a step with fewer chunks than
        # slots would otherwise upload a chunk before the last step's download of it is done
        self._downloaded: dict[int, Ticket] = {}
        self._pin_tried: set[int] = set()  # moments _pin_moments already tried (pinning may fall back)
        self._next = 0
        self._last_down: Ticket = None
        self._step_counts: dict[int, torch.Tensor] = {}  # per group: the step count as the kernel reads it
        self._scale: torch.Tensor | None = None
        # None on a CPU-only machine, where every copy happens at once
        self._up: torch.cuda.Stream | None = None
        self._math: torch.cuda.Stream | None = None
        self._down: torch.cuda.Stream | None = None
        if self.is_async:
            self._up, self._math, self._down = (torch.cuda.Stream(device) for _ in range(3))

    def staging_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self._slots)

    def begin_step(self, adam: HostAdam, factor: float, memory: HostMemory) -> None:
        """Start an update (after `adam.begin_step`): the step counts and the gradient factor its kernels
        read, queued on the math stream behind the last step's kernels."""
        if self.is_async:
            _pin_moments(adam, memory, self._pin_tried)
        with self._on(self._math):
            for group, (step, hp) in enumerate(adam.settings):
                value = float(step) if hp.bias_correction else math.inf  # inf: both corrections are 1
                held = self._step_counts.get(group)
                if held is None:
                    self._step_counts[group] = torch.full((), value, dtype=torch.float32, device=self.device)
                else:
                    held.fill_(value)
            if factor == 1.0:
                self._scale = None
            else:  # the kernel divides the gradients by its grad_scale
                if self._scale is None:
                    self._scale = torch.empty((), dtype=torch.float32, device=self.device)
                self._scale.fill_(1.0 / factor)

    def update_span(
        self,
        adam: HostAdam,
        span: Span,
        master: torch.Tensor,
        grad: torch.Tensor,
        working: torch.Tensor,
        ready: Ticket,
    ) -> Ticket:
        """Update `span` of the host master and `adam`'s moments from the device gradient `grad` once
        `ready` is done, writing the new weights into the device tensor `working`; returns the ticket
        after which `working` holds them."""
        exp_avg, exp_avg_sq = adam.moments(span.group)

        def piece(state: torch.Tensor) -> torch.Tensor:
            return state.view(-1).narrow(0, span.shard_offset, span.numel)

        host = (piece(master), piece(exp_avg), piece(exp_avg_sq))
        # a speculative step (speculative.py) downloads into the shadow, the state stays as it was
        into = tuple(piece(t) for t in adam.written(span.group)) if adam.shadow is not None else None
        hp = adam.settings[span.group][1]
        return self.update(span.group, hp, host, grad, working, ready, into=into)

    def update(
        self,
        group: int,
        hp: AdamHyperparams,
        host: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        grad: torch.Tensor,
        working: torch.Tensor,
        ready: Ticket,
        *,
        into: tuple[torch.Tensor, ...] | None = None,
    ) -> Ticket:
        """Update `host` (master, exp_avg, exp_avg_sq: equal slices of host memory) with the device
        gradient `grad` once `ready` is done, and write the new weights into the device tensor
        `working`; returns the ticket after which `working` holds them. The new state goes back into
        `into` (slices like `host`'s), or over `host` itself (None)."""
        written: Ticket = None
        for offset, numel in plan_chunks(grad.numel(), self.chunk_elems):
            pieces = tuple(t.narrow(0, offset, numel) for t in host)
            back = pieces if into is None else tuple(t.narrow(0, offset, numel) for t in into)
            written = self._chunk(
                group, hp, pieces, grad.narrow(0, offset, numel), working.narrow(0, offset, numel), ready,
                back,
            )  # fmt: skip
        return written

    def _chunk(
        self,
        group: int,
        hp: AdamHyperparams,
        host: tuple[torch.Tensor, ...],
        grad: torch.Tensor,
        working: torch.Tensor,
        ready: Ticket,
        back: tuple[torch.Tensor, ...],
    ) -> Ticket:
        index = self._next
        self._next = (index + 1) % len(self._slots)
        numel = grad.numel()
        param, exp_avg, exp_avg_sq, staged_grad = (row.narrow(0, 0, numel) for row in self._slots[index])
        math_, down = self._math, self._down
        uploaded = self._upload(index, host)
        with self._on(math_):
            _wait(math_, uploaded)
            _wait(math_, ready)
            staged_grad.copy_(grad)
            kernel = torch._fused_adamw_ if hp.adamw_mode else torch._fused_adam_
            kernel(
                [param], [staged_grad], [exp_avg], [exp_avg_sq], [], [self._step_counts[group]],
                lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2, weight_decay=hp.weight_decay, eps=hp.eps,
                amsgrad=False, maximize=False, grad_scale=self._scale,
            )  # fmt: skip
            working.copy_(param)
            written = self._record(math_)
        with self._on(down):
            _wait(down, written)
            for dst, src in zip(back, (param, exp_avg, exp_avg_sq), strict=True):
                dst.copy_(src, non_blocking=True)
            self._free[index] = self._last_down = self._downloaded[back[0].data_ptr()] = self._record(down)
        return written

    def _upload(self, index: int, host: tuple[torch.Tensor, ...]) -> Ticket:
        """Queue the copies of `host` (master, exp_avg, exp_avg_sq) into slot `index`, behind the slot's
        last download and the chunk's own."""
        up = self._up
        with self._on(up):
            _wait(up, self._free[index])
            _wait(up, self._downloaded.get(host[0].data_ptr()))
            for dst, src in zip(self._slots[index], host, strict=False):  # not the gradient's row
                dst.narrow(0, 0, src.numel()).copy_(src, non_blocking=True)
            return self._record(up)

    def host_ready(self) -> None:
        """Block until every download is done: the host copies of the state are current."""
        if self._last_down is not None:
            self._last_down.synchronize()

    def device_wait(self) -> None:
        """Make the current stream wait for every kernel of the math stream (which reads the gradients
        the next backward overwrites, and writes the working weights)."""
        if self._math is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._math)

    def _on(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        if stream is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        # the device context too: the caller may be a thread whose current device is another one
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(stream))
        return stack

    def _record(self, stream: torch.cuda.Stream | None) -> Ticket:
        return stream.record_event() if stream is not None else None


def _pin_moments(adam: HostAdam, memory: HostMemory, tried: set[int]) -> None:
    """Moments loaded from a checkpoint arrive in pageable memory: pin them, or every copy of theirs
    would go through a bounce buffer and hold the host. Once per tensor: where pinning falls back to
    pageable memory (with a warning), the copy is not made again at every step."""
    for group in range(len(adam.masters)):
        moments = adam.moments(group)
        if all(memory.is_pinned(t) or t.data_ptr() in tried for t in moments):
            continue
        pinned = [memory.empty(t.numel(), t.dtype, pinned=True).copy_(t.view(-1)) for t in moments]
        tried.update(p.data_ptr() for p in pinned)
        adam.replace_moments(group, *(p.view(t.shape) for p, t in zip(pinned, moments, strict=True)))


def _wait(stream: torch.cuda.Stream | None, ticket: Ticket) -> None:
    if stream is not None and ticket is not None:
        stream.wait_event(ticket)
