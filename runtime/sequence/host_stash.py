"""Checkpointed activations kept in host memory: copied out on a side stream, prefetched back for backward.

``activation_checkpointing.cpu_checkpointing`` (runtime.activation_checkpointing) keeps each checkpointed
block's input here instead of on the GPU. At long sequences these inputs are what is left of the activations
(one ``[seq, hidden]`` tensor per layer: Llama-8B at 500K tokens keeps 32 x 4 GiB in bf16), so moving
them to the host is what lets the sequence grow until the host fills.

The copies overlap compute:

- forward: the device-to-host copy runs on the stash's own stream, after the producing kernels (the stream
  waits on the compute stream); the device tensor is marked used by that stream (``record_stream``), so
  the allocator reuses its memory only once the copy is done, and compute never waits for the copy;
- backward: inputs come back in reverse order. Taking input k starts the host-to-device copy of input
  k-1 (the next one backward needs) on the side stream, so it arrives while block k recomputes and runs
  its backward; the compute stream waits only on the event of the copy it needs now.

Host buffers are pinned (page-locked) on CUDA, which the asynchronous copies need. Without CUDA the stash
copies synchronously (the same code path; runtime.activation_checkpointing uses it only for tensors off
the CPU).

Why not ``torch.autograd.graph.save_on_cpu``: it moves *every* tensor saved for backward, each copy on the
compute stream (pinned, but serialised with the kernels around it), and copies each back only when
backward asks for it, so every block's backward waits for its own host-to-device copy. Installed around
torch's non-reentrant checkpoint our hooks see only the checkpointed inputs (torch's own hooks take
precedence inside the region), and the side stream plus one-ahead prefetch hide both directions.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["HostCopy", "HostStash"]


class HostCopy:
    """One tensor kept in host memory (``host``), with the events of its copies on CUDA."""

    __slots__ = ("__weakref__", "copied", "device", "host", "prefetched", "ready")

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        self.host = host
        self.device = device
        self.copied: torch.cuda.Event | None = None  # the device-to-host copy is done
        self.prefetched: torch.Tensor | None = None  # the device copy, started ahead of need
        self.ready: torch.cuda.Event | None = None  # `prefetched` has arrived


class HostStash:
    """Copies tensors to host memory and back, in LIFO order with one-ahead prefetch (see the module
    docstring). One stash serves every checkpointed block of a process."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._order: list[weakref.ref[HostCopy]] = []  # kept copies in the order they were put
        self.prefetched = 0  # takes that found their copy already on the way (the overlap's count)

    def _stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def put(self, data: torch.Tensor) -> HostCopy:
        """Start copying ``data`` (on any device) to host memory; returns its handle."""
        stream = self._stream(data.device)
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=stream is not None)
        copy = HostCopy(host, data.device)
        if stream is None:
            host.copy_(data)
        else:
            stream.wait_stream(torch.cuda.current_stream(data.device))
            with torch.cuda.stream(stream):
                host.copy_(data, non_blocking=True)
                copy.copied = torch.cuda.Event()
                copy.copied.record(stream)
            data.record_stream(stream)  # its memory is not reused before the copy has read it
        self._order = [ref for ref in self._order if ref() is not None]  # graphs dropped unused
        self._order.append(weakref.ref(copy))
        return copy

    def _prefetch(self, copy: HostCopy) -> None:
        if copy.prefetched is not None:
            return
        stream = self._stream(copy.device)
        if stream is None:
            copy.prefetched = copy.host.to(copy.device)
        else:
            with torch.cuda.stream(stream):
                copy.prefetched = copy.host.to(copy.device, non_blocking=True)
                copy.ready = torch.cuda.Event()
                copy.ready.record(stream)

    def take(self, copy: HostCopy) -> torch.Tensor:
        """The tensor back on its device (usable on the current stream); prefetches the copy put just
        before it, which backward needs next."""
        position = next((i for i, ref in enumerate(self._order) if ref() is copy), None)
        if position is not None:
            del self._order[position]
            earlier = self._order[position - 1]() if position > 0 else None
        else:
            earlier = None  # taken again (retain_graph): no order to follow
        if copy.prefetched is not None:
            self.prefetched += 1
        self._prefetch(copy)  # a no-op when it is on the way already
        data = copy.prefetched
        assert data is not None
        if copy.ready is not None:
            current = torch.cuda.current_stream(copy.device)
            current.wait_event(copy.ready)
            data.record_stream(current)  # allocated on the side stream, used and freed on this one
        copy.prefetched, copy.ready = None, None  # the handle may be taken again (retain_graph)
        if earlier is not None:
            self._prefetch(earlier)
        return data
