"""The background thread of the delayed parameter update (`enable_delayed_update`), and its share of cores.

Under the delayed update, step k's host update runs while the calling thread computes forward and backward
of step k+1, so it needs a thread of its own: one `HostWorker`, a single thread, so updates run in the
order they were submitted and never two at once.

[Note: one OpenMP pool per core] Every thread that starts parallel regions gets an OpenMP pool of its
own, and once the pools together hold more threads than there are cores, libgomp stops spinning between
regions, so each of a host update's thousands of short regions first wakes its team from sleep: the same
update ran about a third slower on a second thread than on the caller (BENCHMARKS.md, the host-threads
table). Whoever runs a host update next to another thread must keep the pools within the machine.

Here: before the first update the caller's team is cut to 2 threads (a 2-thread region on the caller
releases the rest of its pool) and the worker gets the other cores. The caller keeps 2 intra-op threads
while the delayed update is on (`close` gives the old count back); a GPU training loop's own CPU work
(kernel launches, small copies) does not need more. The streamed step (streamed.py) meets the note the
other way round: it runs autograd on a helper thread instead, and autograd on CUDA starts no parallel
regions.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

CALLER_THREADS = 2


class HostWorker:
    """One background thread for host updates, with the cores the calling thread gives up."""

    def __init__(self) -> None:
        self._caller_threads = torch.get_num_threads()
        self.threads = max(1, self._caller_threads - CALLER_THREADS)
        if self._caller_threads > CALLER_THREADS:
            torch.set_num_threads(CALLER_THREADS)
            torch.ones(1 << 20).add_(1)  # a parallel region with the smaller team releases the rest
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="offload-step",
            initializer=torch.set_num_threads,
            initargs=(self.threads,),
        )

    def submit(self, fn: Callable[..., T], /, *args: object, **kwargs: object) -> Future[T]:
        return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self) -> None:
        """Stop the thread and give the calling thread its intra-op threads back."""
        self._pool.shutdown(wait=True)
        torch.set_num_threads(self._caller_threads)
