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

The device tensor a copy back lands in is allocated on the compute stream, which uses and frees it, and
the side stream first waits for the compute work queued before it. Allocated on the side stream instead
(as before), its free waited for an event on the compute stream, which the CPU, queueing kernels far
ahead of the GPU, finds unfinished: the next prefetch could not reuse it, so a third layer input stayed
on the GPU (the 1B's trace at 131K tokens: 3 blocks where 2 are needed) until the GPU caught up, or until
the allocator, short of memory, stopped to synchronize. On the compute stream a freed input is reused in
stream order at once. A prefetch never taken (a graph dropped before its backward) makes its allocating
stream wait for the copy before the memory goes back (`_Arrival`).

Host buffers are pinned (page-locked) on CUDA, which the asynchronous copies need. torch's pinned caching
allocator rounds every block up to a power of two, which at long sequences doubled the host's cost: a
layer input of 1.24 GiB (the 8B shape at 162,816 tokens) took a 2 GiB block, and the H200 run's host RSS
was 65.7 GiB for 39.8 GiB of inputs. So a tensor is kept in a few blocks that are powers of two already
(`pinned_pieces`: its size, rounded up by at most 1/64, in binary), which the allocator neither rounds
nor fails to reuse: the same lengths take the same blocks step after step. Without CUDA the stash copies
synchronously (the same code path; runtime.activation_checkpointing uses it only for tensors off the CPU).

Why not ``torch.autograd.graph.save_on_cpu``: it moves *every* tensor saved for backward, each copy on the
compute stream (pinned, but serialised with the kernels around it), and copies each back only when
backward asks for it, so every block's backward waits for its own host-to-device copy. Installed around
torch's non-reentrant checkpoint our hooks see only the checkpointed inputs (torch's own hooks take
precedence inside the region), and the side stream plus one-ahead prefetch hide both directions.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

__all__ = ["HostCopy", "HostStash", "pinned_pieces"]

PIECES = 64  # a tensor's blocks cover its size rounded up to a multiple of a power of two <= size / 64
PAGE = 4096


def pinned_pieces(nbytes: int) -> list[int]:
    """The blocks, in bytes, that keep a tensor of `nbytes` in pinned memory: powers of two, largest first,
    summing to `nbytes` rounded up to a multiple of the power of two at or below ``nbytes / PIECES`` (a
    page at least). At most 1/64 (or a page) more than `nbytes`, where the allocator's own rounding is up
    to 2x, in at most 8 blocks."""
    if nbytes <= 0:
        return []
    granule = max(PAGE, 1 << max(0, (nbytes // PIECES).bit_length() - 1))
    total = -(-nbytes // granule) * granule
    return [1 << bit for bit in range(total.bit_length() - 1, -1, -1) if total >> bit & 1]


class _Arrival:
    """A device copy of a kept tensor on its way back: allocated on the compute stream (`stream`), written
    by the side stream until `ready`. Dropped before it is taken, it makes `stream` wait for the copy, so
    the allocator cannot hand the memory to a kernel while the copy still writes it."""

    __slots__ = ("data", "ready", "stream")

    def __init__(
        self, data: torch.Tensor, ready: torch.cuda.Event | None, stream: torch.cuda.Stream | None
    ) -> None:
        self.data: torch.Tensor | None = data
        self.ready, self.stream = ready, stream

    def take(self) -> torch.Tensor:
        """The tensor, usable on the current stream from here on."""
        data, self.data = self.data, None
        assert data is not None
        if self.ready is not None:
            current = torch.cuda.current_stream(data.device)
            current.wait_event(self.ready)
            if current != self.stream:  # used and freed on another stream than the one it came from
                data.record_stream(current)
        return data

    def __del__(self) -> None:
        if self.data is not None and self.stream is not None and self.ready is not None:
            self.stream.wait_event(self.ready)  # before `data` is freed, after this returns


class HostCopy:
    """One tensor kept in host memory (``pieces``: 1-D host tensors, its elements in order), with the events
    of its copies on CUDA."""

    __slots__ = ("__weakref__", "copied", "device", "dtype", "pieces", "prefetched", "shape")

    def __init__(self, pieces: list[torch.Tensor], data: torch.Tensor) -> None:
        self.pieces = pieces
        self.shape, self.dtype, self.device = data.shape, data.dtype, data.device
        self.copied: torch.cuda.Event | None = None  # the device-to-host copy is done
        self.prefetched: _Arrival | None = None  # the device copy, started ahead of need


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
        flat = data.reshape(-1)
        size = data.element_size()
        pieces, start = [], 0
        for nbytes in pinned_pieces(flat.numel() * size):
            count = min(nbytes // size, flat.numel() - start)
            block = torch.empty(nbytes // size, dtype=data.dtype, pin_memory=stream is not None)
            pieces.append((block[:count], flat[start : start + count]))
            start += count
        copy = HostCopy([host for host, _ in pieces], data)
        if stream is None:
            for host, part in pieces:
                host.copy_(part)
        else:
            stream.wait_stream(torch.cuda.current_stream(data.device))
            with torch.cuda.stream(stream):
                for host, part in pieces:
                    host.copy_(part, non_blocking=True)
                copy.copied = torch.cuda.Event()
                copy.copied.record(stream)
            flat.record_stream(stream)  # its memory (data's, or reshape's copy) is kept until read
        self._order = [ref for ref in self._order if ref() is not None]  # graphs dropped unused
        self._order.append(weakref.ref(copy))
        return copy

    def _prefetch(self, copy: HostCopy) -> None:
        if copy.prefetched is not None:
            return
        stream = self._stream(copy.device)
        # on the compute stream, which uses and frees it (module docstring); the side stream writes it
        # only after the compute work queued so far, which may still use the memory's previous tensor
        data = torch.empty(copy.shape, dtype=copy.dtype, device=copy.device)
        current = None
        if stream is not None:
            current = torch.cuda.current_stream(copy.device)
            stream.wait_stream(current)
        ready = None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            flat, start = data.view(-1), 0
            for host in copy.pieces:
                flat[start : start + host.numel()].copy_(host, non_blocking=stream is not None)
                start += host.numel()
            if stream is not None:
                ready = torch.cuda.Event()
                ready.record(stream)
        copy.prefetched = _Arrival(data, ready, current)

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
        arrival = copy.prefetched
        assert arrival is not None
        copy.prefetched = None  # the handle may be taken again (retain_graph)
        data = arrival.take()
        if earlier is not None:
            self._prefetch(earlier)
        return data
