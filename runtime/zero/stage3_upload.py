"""ZeRO-3 `offload_param`: the uploads of host shards on their own CUDA stream, and what they cost.

Under parameter offload each rank's working shard of a unit lives in pinned host memory and is uploaded
into its chunk of the unit's working buffer before the unit's all-gather (stage3_unit.Segment). Queued on
the compute stream, an upload waits for every kernel queued before it and every later kernel waits for
it, so uploads and compute take turns: the GPU idles for the whole transfer time of every unit.

`ShardUploads` gives the uploads a stream of their own. A gather that the scheduler starts early (the
prefetch of stage3_hooks, within `stage3_prefetch_bucket_size` and `stage3_max_live_parameters`, in the
recorded trace order) then runs while the units before it compute:

- the working buffer is allocated on the compute stream (the caching allocator hands out blocks by
  stream, and a block freed by a released unit may still be read by kernels queued there), and the
  upload stream waits for the compute stream as it stood at that moment, so the upload never writes a
  block that queued compute still reads;
- the copy (non_blocking, from pinned memory) and, with more ranks, the all-gather's launch run on the
  upload stream, and an event marks the end;
- `finish_gather` makes the compute stream wait for that event only: compute waits for its own unit's
  weights, not for uploads queued behind them. A unit prefetched and released unused waits the same way
  before its buffer is freed.

The host step may write new weights into a host shard once backward ends (the offloaded update writes
them in place), so `drain` waits on the host for every upload at the end of backward.

On the CPU there is no stream: uploads are plain copies, in order, exactly as without this module. Byte
counts are kept everywhere; upload times (from CUDA events around each upload) only when `timed`, for the
offload bench's "upload time against bytes / PCIe bandwidth".
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

ORDER_KEPT = 4096  # uploads whose unit order UploadStats keeps


@dataclass
class UploadStats:
    """What the uploads of host shards moved, and (when timed) how long the upload stream took."""

    uploads: int = 0
    bytes: int = 0
    # the units uploaded lately, in the order their uploads were queued (bounded: a record, not a log)
    order: deque[int] = field(default_factory=lambda: deque(maxlen=ORDER_KEPT))
    _timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    _seconds: float = 0.0

    def seconds(self) -> float:
        """Busy time of the upload stream over the timed uploads so far (waits for them)."""
        for start, end in self._timed:
            end.synchronize()
            self._seconds += start.elapsed_time(end) / 1000.0
        self._timed.clear()
        return self._seconds

    def reset(self) -> None:
        self.seconds()
        self.uploads, self.bytes, self._seconds = 0, 0, 0.0
        self.order.clear()


class ShardUploads:
    """The upload stream of one ZeRO-3 stage's offloaded shards (none on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.timed = False  # time each upload with CUDA events (the offload bench turns it on)
        self.stats = UploadStats()
        self._last: torch.cuda.Event | None = None

    def use_compute_stream(self) -> None:
        """Queue uploads on the compute stream again, as before this module (the bench's A/B)."""
        self.drain()
        self.stream = None

    @contextlib.contextmanager
    def side(self, unit: int, nbytes: int) -> Iterator[torch.cuda.Event | None]:
        """Run the body (unit `unit`'s uploads of `nbytes` and the gather launches that read them) on the
        upload stream, after what the compute stream has queued so far. Yields the event that will mark
        the body's end (recorded on exit), None on the CPU."""
        self.stats.order.append(unit)
        self.stats.uploads += 1
        self.stats.bytes += nbytes
        if self.device.type != "cuda":
            yield None
            return
        compute = torch.cuda.current_stream(self.device)
        stream = compute if self.stream is None else self.stream
        if stream is not compute:
            stream.wait_stream(compute)
        done = torch.cuda.Event()
        start = torch.cuda.Event(enable_timing=True) if self.timed else None
        with torch.cuda.stream(stream):
            if start is not None:
                start.record()
            yield done
            if start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.stats._timed.append((start, end))
            done.record()
        self._last = done

    @staticmethod
    def wait(done: torch.cuda.Event | None) -> None:
        """The compute stream waits for one body's end (nothing on the CPU)."""
        if done is not None:
            torch.cuda.current_stream().wait_event(done)

    def drain(self) -> None:
        """Wait on the host until every upload queued so far is done (the host may write shards next)."""
        if self._last is not None:
            self._last.synchronize()
            self._last = None
