"""Copies between the training device and host memory, off the compute stream and ordered by events.

On CUDA, gradients go down on one stream and updated weights come up on another, so both directions
run on the copy engines while the compute stream keeps going (and, with pinned host memory, while the
host keeps going). Each copy returns a `Ticket` (the CUDA event recorded after it); the host waits on a
ticket before reading what landed, and the compute stream waits on one before using what came up.

On a CPU-only machine the "device" is host memory too: a copy happens at once and its ticket is None, so
the offload code runs the same copies, in the same order and chunks, with nothing to wait for.
"""

from __future__ import annotations

import torch

Ticket = torch.cuda.Event | None


class CopyEngine:
    """Device-to-host and host-to-device copies for one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_async = device.type == "cuda"
        if self.is_async:
            self._down = torch.cuda.Stream(device)
            self._up = torch.cuda.Stream(device)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        """Copy device `src` into host `dst` once the work queued so far on the current stream (the
        kernels that produced `src`) is done."""
        if not self.is_async:
            dst.copy_(src)
            return None
        self._down.wait_stream(torch.cuda.current_stream(self.device))
        # the device context too: the caller may be a thread whose current device is another one
        with torch.cuda.device(self.device), torch.cuda.stream(self._down):
            dst.copy_(src, non_blocking=True)
        return self._down.record_event()

    def mark(self) -> Ticket:
        """A ticket for the work queued so far on the current stream (what a device-side reader of its
        results waits for)."""
        if not self.is_async:
            return None
        return torch.cuda.current_stream(self.device).record_event()

    def fence_uploads(self) -> None:
        """Order the next uploads after the work queued so far on the current stream: kernels still
        queued there may read the device buffers the uploads overwrite."""
        if self.is_async:
            self._up.wait_stream(torch.cuda.current_stream(self.device))

    def uploads_after(self, ticket: Ticket) -> None:
        """Order the next uploads after the copy behind `ticket` (and so after what that copy waited for)."""
        if ticket is not None:
            self._up.wait_event(ticket)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        """Copy host `src` into device `dst` (after `fence_uploads`); `src` must stay unchanged until the
        ticket is done."""
        if not self.is_async:
            dst.copy_(src)
            return None
        with torch.cuda.device(self.device), torch.cuda.stream(self._up):
            dst.copy_(src, non_blocking=True)
        return self._up.record_event()

    @staticmethod
    def host_wait(ticket: Ticket) -> None:
        """Block the host until the copy behind `ticket` is done."""
        if ticket is not None:
            ticket.synchronize()

    def device_wait(self, ticket: Ticket) -> None:
        """Make the current stream wait for the copy behind `ticket` (the host does not wait)."""
        if ticket is not None:
            torch.cuda.current_stream(self.device).wait_event(ticket)

    def downloads_done(self) -> None:
        """Make the current stream wait for every device-to-host copy issued so far (before it may
        overwrite a gradient buffer that is still being read)."""
        if self.is_async:
            torch.cuda.current_stream(self.device).wait_stream(self._down)
