"""The background thread of the delayed parameter update (`enable_delayed_update`).

Under the delayed update, step k's host update runs while the calling thread computes forward and backward
of step k+1, so it needs a thread of its own: one `HostWorker`, a single thread, so updates run in the
order they were submitted and never two at once.

Its cost, measured on the H200 host: that thread's OpenMP pool comes on top of the caller's, and with
more pool threads than cores libgomp stops spinning between parallel regions, so the update's short
regions wake their teams from sleep each time and the update runs 1.2x (or, with one thread fewer than
the cores, 3x) slower than on the calling thread. The streamed step (streamed.py) avoids this by
running autograd on the helper thread instead; the delayed update cannot, since the caller must run the
next forward.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class HostWorker:
    """One background thread for host updates."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-step")

    def submit(self, fn: Callable[..., T], /, *args: object, **kwargs: object) -> Future[T]:
        return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
