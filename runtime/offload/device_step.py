"""The offloaded Adam step run by the GPU: the state stays in host memory and streams through the device.

Optimizer offload keeps the fp32 master and both Adam moments in host memory. Where they are updated is
a separate choice (`DSLAUNCH_OFFLOAD_UPDATE=auto|host|device`, `choose_update`):

- host: the gradients cross PCIe to the host, the CPU runs the fused Adam kernel, the new weights cross
  back (host_masters.py). Per parameter: 8 bytes over PCIe (fp32 landing) and 36 bytes of host memory
  traffic (the kernel's 28 and both copies), so the host's memory bandwidth limits the step.
- device: a ring of staging slots on the GPU. For each chunk of a span the master and both moments go up
  (12 bytes), the GPU's fused kernel updates them from the gradient that never left the device and
  writes the new working weights in place, and the three go back down (12 bytes). Per parameter: 24
  bytes over PCIe, split evenly between the two directions, 24 bytes of host memory traffic (DMA only),
  no CPU work. On the H200 (PCIe 5, 49 GB/s each way with both directions busy) GPT-2 XL's 1.56B
  parameters took 0.38 s this way, about torch's fused CPU step alone, against 0.56-0.64 s for the
  host step with its copies, and it runs while backward computes.

The two can share a step: with `DSLAUNCH_OFFLOAD_HOST_SHARE=f` the GPU streams the head of every span
and the CPU updates its tail, about f of its elements, from gradients landed on the host (only the tails
land, into buffers their size). Both work on every span at once, from the first span backward hands over:
PCIe carries the GPU's state and the CPU's gradients and weights, the host's cores and memory bandwidth
the CPU's update, and the step takes about the longer of the two halves.

A `DeviceStep` owns the slots and three CUDA streams: `up` (host to slots), `math` (gradient into fp32,
Adam, new working weights) and `down` (slots to host). Each chunk's upload waits until the slot's last
download is done; its math waits for the upload and for the span's gradients to be final (the span's
ticket, recorded on the compute stream when its bucket was done); its download waits for the math. The
host never waits: it only queues, so the streamed step's calling thread keeps up with autograd. The
host copies of the state are up to date once `host_ready` has waited for the last download; everything
that reads them (a checkpoint, the host path, `state_dict`) goes through `HostMasters.flush` first.

On a CPU-only machine the "device" is host memory and every copy happens at once: the same chunks, slots
and kernel calls run in order, which is what the tests on gloo check against plain PyTorch.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch

from runtime.comm import Comm
from runtime.distributed import local_world_size
from runtime.memory import host_available_bytes
from runtime.offload.copies import Ticket
from runtime.offload.host_adam import HostAdam
from runtime.offload.host_memory import HostMemory
from runtime.offload.spans import CHUNK_ALIGN, Span, plan_chunks
from runtime.ops.adam_step import AdamHyperparams
from runtime.zero.partition import align_up

UPDATE_ENV = "DSLAUNCH_OFFLOAD_UPDATE"
UPDATE_SETTINGS = ("auto", "host", "device")
HOST_SHARE_ENV = "DSLAUNCH_OFFLOAD_HOST_SHARE"
DEFAULT_HOST_SHARE = 0.0
"""The fraction of the elements whose update the CPU takes when the GPU runs the step, with one rank on
the host (`default_host_share` scales it for more)."""
DEVICE_CHUNK_ELEMS = 1 << 24
"""Elements per staging slot: 16M, 256 MiB of fp32 master, moments and gradient; on the H200 16M-element
chunks with 4 slots ran at 49.6 GB/s each way, 32M with 3 at 48.4 and 64M with 2 at 47.0."""
DEVICE_SLOTS = 4
PIN_ROOM_BYTES_PER_PARAM = 16
"""What "auto" wants available per parameter of the shard before it pins the 12 bytes of state: the same
rule as fp32 landing (landing.py), so a host that gave the CPU step fp32 landing gives the device step
room, and the largest models (8.44B on the 126 GiB H200 host) keep the CPU step, which pins 2 bytes."""
PIN_HEADROOM = 4 << 30  # per rank, like landing.FP32_LANDING_HEADROOM


@dataclass(frozen=True)
class UpdateChoice:
    """Where the offloaded Adam step runs, and why (the engine logs it at startup)."""

    on_device: bool
    reason: str
    host_share: float = 0.0  # with on_device: the fraction of the elements the CPU updates


def default_host_share(local_ranks: int, one_rank: float | None = None) -> float:
    """The CPU's share with `local_ranks` ranks on this host, from `one_rank`, the share that balances one
    rank's halves. Each rank's GPU has its own PCIe link, but the ranks split the host's cores, so a rank's
    CPU half takes `local_ranks` times as long: with r = (1 - one_rank) / one_rank, the time the CPU takes
    per element over the GPU's, the balance is 1 / (1 + local_ranks * r). `one_rank` defaults to
    DEFAULT_HOST_SHARE."""
    one_rank = DEFAULT_HOST_SHARE if one_rank is None else one_rank
    if one_rank <= 0.0 or local_ranks < 1:
        return 0.0
    return 1.0 / (1.0 + local_ranks * (1.0 - one_rank) / one_rank)


def parse_host_share(value: str) -> float:
    """`DSLAUNCH_OFFLOAD_HOST_SHARE`: a fraction from 0 (the GPU updates everything) to 1."""
    try:
        share = float(value)
    except ValueError:
        share = math.nan
    if not 0.0 <= share <= 1.0:  # also false for nan
        raise ValueError(
            f"{HOST_SHARE_ENV}={value!r}: expected the fraction of the Adam step the CPU takes while the "
            f"GPU runs the rest, from 0 to 1 (default {DEFAULT_HOST_SHARE})"
        )
    return share


def choose_update(
    *,
    setting: str = "auto",
    on_gpu: bool,
    adam: bool,
    weights_on_host: bool,
    pinned: bool,
    shard_numel: int = 0,
    local_ranks: int = 1,
    host_available: int | None = None,
    device_free: int | None = None,
    host_share: float = DEFAULT_HOST_SHARE,
) -> UpdateChoice:
    """The update placement for this run. `setting` is `DSLAUNCH_OFFLOAD_UPDATE`: host or device when it
    says so (device only where it can run), else device exactly where it can run and pays: a GPU, Adam or
    AdamW, pinned host state, working weights on the device, host memory with room to pin the state
    (`host_available` bytes shared by `local_ranks` ranks) and a device with room for the staging slots
    (at most 1/8 of its `device_free` bytes: the model came to the GPU already, its activations have not);
    None: not checked. With the device, the CPU still updates `host_share` of the elements."""
    setting = setting.strip().lower() or "auto"
    if setting not in UPDATE_SETTINGS:
        raise ValueError(
            f"{UPDATE_ENV}={setting!r}: expected one of {', '.join(UPDATE_SETTINGS)} (default auto)"
        )
    if setting == "host":
        return UpdateChoice(False, f"the CPU runs the Adam step ({UPDATE_ENV}=host)")
    blocker = None
    if not adam:
        blocker = "the optimizer is not Adam or AdamW (or uses options the fused kernel lacks)"
    elif weights_on_host:
        blocker = "offload_param keeps the working weights in host memory"
    elif on_gpu and not pinned:
        blocker = "offload_optimizer.pin_memory is false, and the state could not stream asynchronously"
    if setting == "device":
        if blocker is not None:
            return UpdateChoice(False, f"the CPU runs the Adam step although {UPDATE_ENV}=device: {blocker}")
        return UpdateChoice(
            True,
            f"the GPU runs the Adam step on state streamed from host memory ({UPDATE_ENV}=device)"
            + _sharing(host_share),
            host_share,
        )
    if not on_gpu:
        return UpdateChoice(False, "the CPU runs the Adam step (no GPU)")
    if blocker is not None:
        return UpdateChoice(False, f"the CPU runs the Adam step: {blocker}")
    gib = 1 << 30
    need = (shard_numel * PIN_ROOM_BYTES_PER_PARAM + PIN_HEADROOM) * local_ranks
    if host_available is not None and host_available < need:
        return UpdateChoice(
            False,
            f"the CPU runs the Adam step: streaming the state through the GPU pins all of it, and this host "
            f"has {host_available / gib:.1f} GiB available of the {need / gib:.1f} GiB that {local_ranks} "
            f"rank(s) would want; {UPDATE_ENV}=device insists",
        )
    staging = staging_bytes()
    if device_free is not None and staging * 8 > device_free:
        return UpdateChoice(
            False,
            f"the CPU runs the Adam step: the GPU has {device_free / gib:.1f} GiB free, too little to spare "
            f"{staging / gib:.2f} GiB for the device step's staging; {UPDATE_ENV}=device insists",
        )
    return UpdateChoice(
        True,
        "the GPU runs the Adam step on state streamed from pinned host memory (24 bytes a parameter over "
        f"PCIe, no CPU pass over host memory){_sharing(host_share)}; {UPDATE_ENV}=host runs it all on the "
        "CPU",
        host_share,
    )


def _sharing(share: float) -> str:
    if share == 0.0:
        return ""
    return f", and the CPU updates {share:.0%} of the elements at the same time ({HOST_SHARE_ENV})"


def staging_bytes(chunk_elems: int | None = None, slots: int | None = None) -> int:
    """Device bytes of a `DeviceStep`'s slots: master, both moments and the fp32 gradient per element."""
    chunk = align_up(DEVICE_CHUNK_ELEMS if chunk_elems is None else chunk_elems, CHUNK_ALIGN)
    return (DEVICE_SLOTS if slots is None else slots) * 4 * chunk * 4


def update_choice(
    *, device: torch.device, weights_on_host: bool, pinned: bool, shard_numel: int
) -> UpdateChoice:
    """`choose_update` with the variable, the host memory left to this process, the ranks on this host
    and the device's free memory read here (Adam is assumed; `HostMasters.bind` checks the optimizer)."""
    on_gpu = device.type == "cuda"
    share = os.environ.get(HOST_SHARE_ENV, "").strip()
    return choose_update(
        setting=os.environ.get(UPDATE_ENV, "auto"),
        on_gpu=on_gpu,
        adam=True,
        weights_on_host=weights_on_host,
        pinned=pinned,
        shard_numel=shard_numel,
        local_ranks=local_world_size(),
        host_available=host_available_bytes() if on_gpu else None,
        device_free=torch.cuda.mem_get_info(device)[0] if on_gpu else None,
        host_share=parse_host_share(share) if share else default_host_share(local_world_size()),
    )


def agree_on_update(choice: UpdateChoice, comm: Comm, device: torch.device) -> UpdateChoice:
    """The placement every rank uses: the device only where all ranks chose it, so every shard takes the
    same arithmetic and no rank waits on a slower one's host."""
    on_device = comm.count(choice.on_device, device)
    if on_device in (0, comm.world_size):
        return choice
    return UpdateChoice(
        False,
        f"the CPU runs the Adam step: {comm.world_size - on_device} of {comm.world_size} ranks cannot "
        "stream the state through their GPU",
    )


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
        slots = DEVICE_SLOTS if slots is None else slots
        self.is_async = device.type == "cuda"
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
        state = (master, *adam.moments(span.group))
        host = tuple(t.view(-1).narrow(0, span.shard_offset, span.numel) for t in state)
        hp = adam.settings[span.group][1]
        return self.update(span.group, hp, host, grad, working, ready)

    def update(
        self,
        group: int,
        hp: AdamHyperparams,
        host: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        grad: torch.Tensor,
        working: torch.Tensor,
        ready: Ticket,
    ) -> Ticket:
        """Update `host` (master, exp_avg, exp_avg_sq: equal slices of host memory) with the device
        gradient `grad` once `ready` is done, and write the new weights into the device tensor
        `working`; returns the ticket after which `working` holds them."""
        written: Ticket = None
        for offset, numel in plan_chunks(grad.numel(), self.chunk_elems):
            pieces = tuple(t.narrow(0, offset, numel) for t in host)
            written = self._chunk(
                group, hp, pieces, grad.narrow(0, offset, numel), working.narrow(0, offset, numel), ready
            )
        return written

    def _chunk(
        self,
        group: int,
        hp: AdamHyperparams,
        host: tuple[torch.Tensor, ...],
        grad: torch.Tensor,
        working: torch.Tensor,
        ready: Ticket,
    ) -> Ticket:
        index = self._next
        self._next = (index + 1) % len(self._slots)
        numel = grad.numel()
        param, exp_avg, exp_avg_sq, staged_grad = (row.narrow(0, 0, numel) for row in self._slots[index])
        up, math_, down = self._up, self._math, self._down
        key = host[0].data_ptr()
        with self._on(up):
            _wait(up, self._free[index])
            _wait(up, self._downloaded.get(key))
            for dst, src in zip((param, exp_avg, exp_avg_sq), host, strict=True):
                dst.copy_(src, non_blocking=True)
            uploaded = self._record(up)
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
            for dst, src in zip(host, (param, exp_avg, exp_avg_sq), strict=True):
                dst.copy_(src, non_blocking=True)
            self._free[index] = self._last_down = self._downloaded[key] = self._record(down)
        return written

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
