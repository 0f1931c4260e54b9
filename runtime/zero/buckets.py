"""Which gradient buckets are complete during backward, and launching their collectives in a fixed order.

Every rank must issue its collectives in the same order, whatever order autograd happens to finish
parameters in. `BucketTracker` therefore fixes one global order of (group, bucket) up front, ordered by
when the bucket is expected to complete (gradients arrive roughly in reverse registration order, so a
bucket is ready when its earliest-registered parameter is), counts down each bucket's parameters as their
gradients arrive, and launches ready buckets strictly in that order. A bucket that completes early waits
for its predecessors; `flush()` launches whatever is left at the end of backward (parameters that got no
gradient this time contribute zeros).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from runtime.zero.flat import FlatGroup


def bucket_order(groups: Sequence[FlatGroup], registration: dict[nn.Parameter, int]) -> list[tuple[int, int]]:
    """All (group index, bucket index) pairs, in the order their gradients are expected to be complete."""
    keyed = []
    for g, group in enumerate(groups):
        for bucket in group.layout.buckets:
            earliest = min((registration.get(group.params[i], -1) for i in bucket.params), default=-1)
            keyed.append((-earliest, g, bucket.index))
    keyed.sort()
    return [(g, b) for _, g, b in keyed]


class BucketTracker:
    """Counts parameters per bucket and calls `launch(group, bucket)` for complete buckets, in order."""

    def __init__(
        self,
        groups: Sequence[FlatGroup],
        order: Sequence[tuple[int, int]],
        launch: Callable[[FlatGroup, int], None],
    ) -> None:
        self.groups = groups
        self.order = list(order)
        self._launch = launch
        position = {key: i for i, key in enumerate(self.order)}
        self._sizes = [len(groups[g].layout.buckets[b].params) for g, b in self.order]
        self._position_of: dict[nn.Parameter, int] = {}
        for g, group in enumerate(groups):
            for param, slot in zip(group.params, group.layout.slots, strict=True):
                self._position_of[param] = position[(g, slot.bucket)]
        self._left = list(self._sizes)
        self._ready = [False] * len(self.order)
        self._next = 0

    def reset(self) -> None:
        """Start counting a new backward pass."""
        self._left = list(self._sizes)
        self._ready = [False] * len(self.order)
        self._next = 0

    def position(self, param: nn.Parameter) -> int:
        return self._position_of[param]

    def mark(self, param: nn.Parameter) -> None:
        """`param`'s gradient for this backward is final."""
        pos = self._position_of[param]
        self._left[pos] -= 1
        if self._left[pos] < 0:
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} finished its gradient twice in one backward "
                "pass; the engine reduces each gradient once per backward (reentrant activation "
                "checkpointing does this: use torch.utils.checkpoint with use_reentrant=False)"
            )
        if self._left[pos] == 0:
            self._ready[pos] = True
            self._launch_ready()

    def flush(self) -> None:
        """Launch every bucket not launched yet, in order (end of backward)."""
        for pos in range(self._next, len(self.order)):
            self._ready[pos] = True
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.order) and self._ready[self._next]:
            g, b = self.order[self._next]
            self._next += 1
            self._launch(self.groups[g], b)
