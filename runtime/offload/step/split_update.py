"""Who updates each span of the offloaded step: the GPU its head, the CPU its tail.

A span's Adam update can run in two places, and the plan chooses (runtime/offload/plan.py): the device
step (device_step.py) streams the master and moments of the span's head through the GPU, the host step
(host_step.py) updates its tail from gradients that landed on the host. With the host step alone every
span is all tail; with the device step alone all head; with `offload_optimizer.host_share` each span is
cut at a cache line (`io/spans.share_span`).

A `SplitUpdate` owns that split and the device step's life around a step: `begin` before the first span
(the step counts and scale its kernels read), `update` per span (a (head, tail) pair of tickets: the
device's part is written once the first is done, the host's once the second is), and `to_host`, which
hands every span to the CPU for good (an optimizer the GPU's kernel cannot run, the delayed update).
`HostMasters` composes it with the landing buffers and decides when each span is ready.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.host_memory import HostMemory
from runtime.offload.io.copies import Ticket
from runtime.offload.io.landing import GradLanding
from runtime.offload.io.spans import Span, share_span
from runtime.offload.step.device_step import DeviceStep
from runtime.offload.step.host_adam import HostAdam
from runtime.offload.step.host_step import HostStep
from runtime.zero.flat import FlatGroup

HeadTail = tuple[Ticket, Ticket]
"""Per span, a ticket for its head (the device's part) and one for its tail (the host's); None: none to
wait for."""


class SplitUpdate:
    """Each span's (head, tail) parts, and the steps that update them."""

    def __init__(
        self,
        groups: Sequence[FlatGroup],
        spans: Sequence[Span],
        host: HostStep,
        device_step: DeviceStep | None,
        host_share: float,
    ) -> None:
        self.groups = groups
        self.spans = spans
        self.host = host
        self.device_step = device_step
        share = host_share if device_step is not None else 1.0
        self.parts: list[tuple[Span, Span]] = [share_span(span, share) for span in spans]

    @property
    def on_device(self) -> bool:
        return self.device_step is not None

    @property
    def tails(self) -> list[Span]:
        """The part of every span the CPU updates: what lands on the host."""
        return [tail for _, tail in self.parts]

    @property
    def host_works(self) -> bool:
        """Whether the CPU updates any elements (the device step alone only queues work)."""
        return any(tail.numel for _, tail in self.parts)

    def begin(self, adam: HostAdam, factor: float, memory: HostMemory) -> None:
        """Start one update: step counts and hyperparameters (and, on the device, what its kernels read)."""
        adam.begin_step()
        if self.device_step is not None:
            self.device_step.begin_step(adam, factor, memory)

    def update(
        self,
        adam: HostAdam,
        grad_scale: torch.Tensor | None,
        grads: GradLanding,
        landing: list[torch.Tensor] | None,
        ready: HeadTail,
        index: int,
        dst: torch.Tensor,
    ) -> HeadTail:
        """Update span `index` into `dst`: its head on the device once its gradients are final there
        (`ready[0]`), then its tail on the host once it has landed in `landing` (None: `grads`' buffers;
        `ready[1]`), while the device works. Returns the tickets after which `dst`'s head and tail hold
        the new weights."""
        head, tail = self.parts[index]
        written: Ticket = None
        uploaded: Ticket = None
        if head.numel:
            assert self.device_step is not None
            master = self.groups[head.group].master.data
            grad = grads.source(index).narrow(0, 0, head.numel)
            piece = dst.narrow(0, 0, head.numel)
            written = self.device_step.update_span(adam, head, master, grad, piece, ready[0])
        if tail.numel:
            landed = grads.landed_grad(index, landing)
            piece = dst.narrow(0, head.numel, tail.numel)
            uploaded = self.host.update_span(adam, grad_scale, landed, ready[1], tail, piece)
        return written, uploaded

    def host_ready(self) -> None:
        """Block until the host copies of master and moments are current and free to rewrite."""
        if self.device_step is not None:
            self.device_step.host_ready()

    def device_wait(self) -> None:
        """The current stream waits for the device step's kernels (no-op without one)."""
        if self.device_step is not None:
            self.device_step.device_wait()

    def staging_bytes(self) -> int:
        return 0 if self.device_step is None else self.device_step.staging_bytes()

    def to_host(self) -> bool:
        """From now on the CPU updates every span whole; False if it already did. Between steps."""
        if self.device_step is None:
            return False
        self.device_step.host_ready()
        on_gpu = self.device_step.is_async
        self.device_step = None
        if on_gpu:  # the staging slots' memory goes back to the device, not torch's cache
            torch.cuda.empty_cache()
        self.parts = [share_span(span, 1.0) for span in self.spans]
        return True
