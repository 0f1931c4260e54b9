"""The streamed offload step: the host updates each span as soon as it lands, while backward still runs.

When the step's gradient factor is known before backward (no clipping, no fp16 overflow check:
`GradMath.factor_before_backward`) and gradients stream to the host bucket by bucket (one rank, stages 1
and 2), nothing stops the host from updating a span as soon as it has landed. With a check and no
clipping (`factor_before_verdict`) the same step runs speculatively, into a second copy of the state
(speculative.py). A `StreamedStep` owns that
one boundary backward: the spans that landed and wait for their update, and how many were updated.

Threads: autograd runs on a helper thread and the thread that called `engine.backward` does the updates.
When the GPU runs the step (device_step.py) the calling thread only queues its copies and kernels.
It is this way round, not a worker thread for the updates, because of [Note: one OpenMP pool per core]
(worker.py): autograd on CUDA starts no parallel regions (its device thread only launches kernels), so
the caller's pool stays the only one, and the update runs as it does after backward. On CUDA the
caller's team gives up one thread while backward runs: autograd's device thread then has a core of its
own, instead of sharing one with an update thread that every parallel region of the update would wait
for (one thread fewer cost the update a few percent on the H200 host).

Order and safety: spans land in a fixed order (`runtime.zero.buckets.BucketTracker`) and are updated in
that order. A span lands only after autograd has finished every parameter in it, so the backward kernels
that read its weights are already queued ahead of its upload (which waits for the span's download,
which waited for them). What has not been updated when backward returns is updated by `drain`, from
`step`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from runtime.offload.step.host_adam import HostAdam


class StreamedStep:
    """The host update of one boundary backward, span by span as the spans land."""

    def __init__(
        self, adam: HostAdam, factor: float, update: Callable[[int], None], *, spare_core: bool
    ) -> None:
        self.adam = adam
        self.spare_core = spare_core
        self.factor = factor
        self.updated = 0  # spans whose master, state and upload are done or under way
        self._update = update
        self._landed: queue.SimpleQueue[int | None] = queue.SimpleQueue()

    def landed(self, index: int) -> None:
        """Span `index` is on the host (called from autograd's thread)."""
        self._landed.put(index)

    def run_backward(self, backward: Callable[[], None]) -> None:
        """Run `backward` on a helper thread and update spans here as they land, until it returns;
        re-raises what `backward` raised."""
        failure: list[BaseException] = []

        def run() -> None:
            try:
                backward()
            except BaseException as exc:  # handed to the calling thread, which re-raises it
                failure.append(exc)
            finally:
                self._landed.put(None)

        threads = torch.get_num_threads()
        if self.spare_core and threads > 1:
            torch.set_num_threads(threads - 1)  # autograd's device thread keeps a core to itself
        helper = threading.Thread(target=run, name="dslaunch-backward", daemon=True)
        helper.start()
        try:
            while (index := self._landed.get()) is not None:
                self._run(index)
        finally:
            helper.join()  # never leave autograd running behind an error of ours
            torch.set_num_threads(threads)
        if failure:
            raise failure[0]

    def drain(self) -> None:
        """Update every span that has landed and is not updated yet."""
        while True:
            try:
                index = self._landed.get_nowait()
            except queue.Empty:
                return
            if index is not None:
                self._run(index)

    def _run(self, index: int) -> None:
        self.updated += 1  # counted first: a failed update has touched the masters too
        self._update(index)
