"""The delayed parameter update of optimizer offload (ZeRO-Offload's DPU, §5.2), opt-in through
`runtime.offload.enable_delayed_update`.

After `after_steps` ordinary steps, step k only starts the host update with step k's gradients, on the
worker thread (worker.py), and returns; the update runs (and its weights are uploaded into a device
staging buffer) while the device computes forward and backward of step k+1, and step k+1 installs it
(one device-side copy) before starting its own. So the forward of step k+1 still uses the weights from
before step k's update: every gradient is computed on weights one update stale. The step then costs
about max(device compute, host update) instead of their sum.

Costs: a second landing buffer (the next backward lands there while the update reads the first; 2
bytes/param, host, pinned) and the staging buffer (2 bytes/param of the shard, device), and the calling
thread keeps 2 intra-op threads while it is on (worker.py says why). Adam/AdamW runs delayed over fp32
masters (host_adam.py's one pass) and over bf16 ones (the optimizer's own `step`, with the settings read
when the step started: precision.MasterAdam). Reading the masters or the optimizer state (checkpoints,
`full_state_dict`) must first install the update in flight (`HostMasters.flush`).

`DelayedUpdate` owns those buffers, the thread and the update in flight; `HostMasters` decides when to
start and install.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from runtime.host_memory import HostMemory
from runtime.offload.io.copies import Ticket
from runtime.offload.io.spans import Span
from runtime.offload.step.worker import HostWorker
from runtime.zero.flat import FlatGroup

_log = logging.getLogger("runtime.offload")

# run(landing, tickets, dst_of) -> the last upload's ticket: the whole update of one step
Update = Callable[[list[torch.Tensor], list[Ticket], Callable[[Span], torch.Tensor]], Ticket]


class DelayedUpdate:
    """The buffers, the worker thread and the update in flight of the delayed parameter update."""

    def __init__(
        self,
        after_steps: int,
        landing: Sequence[torch.Tensor],
        groups: Sequence[FlatGroup],
        memory: HostMemory,
        working_dtype: torch.dtype,
    ) -> None:
        self.after_steps = check_after_steps(after_steps)
        self._spare_landing = [memory.zeros(t.numel(), t.dtype, pinned=True) for t in landing]
        dtype = working_dtype  # the install is a same-dtype device copy
        self._staging = [
            torch.empty(g.layout.shard_numel, dtype=dtype, device=g.working.device) for g in groups
        ]
        self._worker = HostWorker()
        self._in_flight: Future[Ticket] | None = None
        self._said_in_place = False  # the note on an optimizer it cannot delay, said once

    def due(self, steps_done: int) -> bool:
        return steps_done >= self.after_steps

    @property
    def pending(self) -> bool:
        return self._in_flight is not None

    def start(
        self, update: Update, landing: list[torch.Tensor], tickets: Sequence[Ticket]
    ) -> list[torch.Tensor]:
        """Run `update` on the worker over `landing` (uploading into the staging buffer); returns the
        landing buffers the next backward must use instead."""
        staging = self._staging

        def dst_of(span: Span) -> torch.Tensor:
            return staging[span.group].narrow(0, span.shard_offset, span.numel)

        self._in_flight = self._worker.submit(update, landing, list(tickets), dst_of)
        spare, self._spare_landing = self._spare_landing, landing
        return spare

    def wait(self) -> Ticket:
        """Wait for the update in flight (re-raising its error); its last upload's ticket."""
        assert self._in_flight is not None
        future, self._in_flight = self._in_flight, None
        return future.result()

    def takes(self, optimizer: Any, per_tensor: bool) -> bool:
        """Whether an optimizer with its own step (bf16 masters' `MasterAdam`) runs delayed: one that hands
        its settings over to the worker (`hyperparameters`); others step in place, which it says once."""
        if not per_tensor and callable(getattr(optimizer, "hyperparameters", None)):
            return True
        if not self._said_in_place:
            self._said_in_place = True
            _log.warning(
                "the delayed parameter update covers Adam/AdamW (fp32 or bf16 masters); %s steps in place",
                type(optimizer).__name__,
            )
        return False

    def install(self, copies: Any, spans: Sequence[Span], publisher: Any) -> None:
        """Wait for the update in flight, if any (re-raising its error), and make it the working weights:
        each span copied from the staging buffer and published (io/targets.Publisher)."""
        if not self.pending:
            return
        copies.device_wait(self.wait())
        for span in spans:
            publisher.piece(span).copy_(self.staged(span))
            publisher.publish(span, (None, None))

    def staged(self, span: Span) -> torch.Tensor:
        """The updated weights of `span` on the device, once `wait` has returned."""
        return self._staging[span.group].narrow(0, span.shard_offset, span.numel)

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._spare_landing)

    def close(self) -> None:
        self._worker.shutdown()


def check_after_steps(after_steps: int) -> int:
    if after_steps < 0:
        raise ValueError(f"delayed update: after_steps must be >= 0, got {after_steps}")
    return after_steps
