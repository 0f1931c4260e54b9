"""The offloaded step on the CPU, span by span, from gradients that landed in host memory.

`HostMasters` runs this where the GPU does not run the step (device_step.py): on a CPU-only machine,
for optimizers other than Adam/AdamW, with offload_param, under the delayed update, or with
`offload_optimizer.update: "host"`.

- Adam/AdamW (`update_span`): each landed span is updated chunk by chunk (`host_adam.py`: one pass, the
  scale applied in the kernel, the updated bf16 weights written over the consumed gradient chunk), and
  each chunk's copy back to the device starts as soon as the chunk is done, so it overlaps the next
  chunk's update. With fp32 landing the kernel is torch's fused one alone and the fp32 master itself is
  copied back (converted on the device). With offload_param the working shard is host memory and the
  kernel writes the new weights straight into it.
- Any other torch optimizer (`generic`): the landed gradient is converted into an fp32 host buffer and
  scaled, `optimizer.step()` runs on the host masters, and the updated masters are cast into the landing
  buffer and copied back. Correct for any optimizer, but several passes over host memory. Bf16 masters
  (`precision.MasterAdam`) take this path too, without the conversion, and may run it delayed.

Owns the per-chunk order of a span's update and copy-back, and the generic path's fp32 gradient buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from runtime.offload.io.copies import CopyEngine, Ticket
from runtime.offload.io.spans import Span, plan_chunks
from runtime.offload.placement import attach_master_grads
from runtime.offload.step.delayed import Update
from runtime.offload.step.host_adam import HostAdam
from runtime.zero.flat import FlatGroup


class HostStep:
    """The CPU's update of landed spans into the working weights."""

    def __init__(
        self,
        groups: Sequence[FlatGroup],
        copies: CopyEngine,
        chunk_elems: int,
        *,
        writes_out: bool,
        weights_on_host: bool,
    ) -> None:
        self.groups = list(groups)
        self.copies = copies
        self.chunk_elems = chunk_elems
        # 16-bit landing: the updated weights go back in that dtype, written over the landed gradient;
        # fp32 landing: straight from the (pinned) master, converted on the device
        self.writes_out = writes_out
        self.weights_on_host = weights_on_host
        self._fp32_grads: list[torch.Tensor] | None = None  # the generic path's, made on first use

    def update_span(
        self,
        adam: HostAdam,
        grad_scale: torch.Tensor | None,
        landed: torch.Tensor,
        ticket: Ticket,
        span: Span,
        dst: torch.Tensor,
    ) -> Ticket:
        """Update one span from its `landed` gradients chunk by chunk into `dst`, each chunk's upload
        started as soon as the chunk is done (after the span's download, and so after the kernels that
        were queued before it); returns the last upload's ticket."""
        self.copies.host_wait(ticket)
        self.copies.uploads_after(ticket)
        master = adam.written(span.group)[0]  # the shadow's during a speculative step (speculative.py)
        # offloaded parameters: the piece is host memory, so the kernel writes the new weights there
        direct = self.writes_out and dst.device.type == "cpu" and self.weights_on_host
        last: Ticket = None
        for offset, numel in plan_chunks(span.numel, self.chunk_elems):
            at = span.shard_offset + offset
            grad = landed.narrow(0, offset, numel)
            if direct:
                adam.update(span.group, at, grad, dst.narrow(0, offset, numel), grad_scale)
                continue
            out = grad if self.writes_out else None
            adam.update(span.group, at, grad, out, grad_scale)
            source = out if out is not None else master.narrow(0, at, numel)
            last = self.copies.to_device(dst.narrow(0, offset, numel), source)
        return last

    def generic(
        self,
        optimizer: torch.optim.Optimizer,
        coef: float,
        *,
        per_tensor: bool,
        landing: list[torch.Tensor],
        tickets: Sequence[Ticket],
        spans: Sequence[Span],
        dst_of: Callable[[Span], torch.Tensor],
        uploaded: Callable[[Span, Ticket], None],
        step: Callable[[], object] | None = None,
    ) -> None:
        """`optimizer.step()` (or `step()`, when given) on the host masters with the landed gradients
        times `coef`, then every span copied back into `dst_of(span)`; `uploaded(span, ticket)` as each
        span's copies are queued."""
        for ticket in tickets:
            self.copies.host_wait(ticket)
        grads = []
        for index, group in enumerate(self.groups):
            grad = landing[index]
            if grad.dtype != group.master.dtype:
                if self._fp32_grads is None:
                    self._fp32_grads = [torch.empty_like(g.master.data) for g in self.groups]
                grad = self._fp32_grads[index].copy_(grad)
            if coef != 1.0:
                grad.mul_(coef)
            grads.append(grad)
        attach_master_grads(optimizer, self.groups, grads, per_tensor=per_tensor)
        if step is None:
            optimizer.step()
        else:
            step()
        attach_master_grads(optimizer, self.groups, None, per_tensor=per_tensor)
        for span in spans:
            master = self.groups[span.group].master.data
            dst = dst_of(span)
            last: Ticket = None
            for offset, numel in plan_chunks(span.numel, self.chunk_elems):
                at = span.shard_offset + offset
                source = master.narrow(0, at, numel)
                if self.writes_out:
                    source = landing[span.group].narrow(0, at, numel).copy_(source)
                last = self.copies.to_device(dst.narrow(0, offset, numel), source)
            uploaded(span, last)

    def own_update(self, optimizer: Any, coef: float, spans: Sequence[Span]) -> Update:
        """The generic step of an optimizer with its own `step(hyperparameters=...)` (precision.MasterAdam)
        as the delayed update runs it on its worker: the settings are read here, on the caller's thread,
        since its scheduler changes them as soon as the engine's step returns."""
        settings = optimizer.hyperparameters()

        def update(
            landing: list[torch.Tensor], tickets: list[Ticket], dst_of: Callable[[Span], torch.Tensor]
        ) -> Ticket:
            last: list[Ticket] = [None]

            def uploaded(span: Span, ticket: Ticket) -> None:
                last[0] = ticket or last[0]

            self.generic(
                optimizer,
                coef,
                per_tensor=False,
                landing=landing,
                tickets=tickets,
                spans=spans,
                dst_of=dst_of,
                uploaded=uploaded,
                step=lambda: optimizer.step(hyperparameters=settings),
            )
            return last[0]

        return update

    def host_bytes(self) -> int:
        """The generic path's fp32 gradient buffers, once made."""
        if self._fp32_grads is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._fp32_grads)
