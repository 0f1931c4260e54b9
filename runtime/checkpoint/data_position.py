"""Where the engine's data loader stands in its epoch, saved with a checkpoint and restored on resume.

`ResumableSampler` is torch's DistributedSampler plus a start index: the first iteration after a
restore skips the samples this rank had already consumed (by index, so nothing is loaded to skip it).
`ResumableDataLoader` counts the samples it hands out, so its `state_dict()` is the exact position:
epoch, samples consumed by each rank in that epoch, and the world size then. Loading at another world
size keeps the global position: a rank skips (consumed x old world) / new world samples of the same
shuffled order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

_log = logging.getLogger("runtime.checkpoint")


class ResumableSampler(DistributedSampler):
    """DistributedSampler whose next iteration can start part-way into the epoch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.start_index = 0  # samples of this rank's share to skip at the next __iter__

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start_index = 0  # a restored position belongs to the restored epoch only
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self.start_index = self.start_index, 0
        return iter(indices[start:])

    def __len__(self) -> int:
        return self.num_samples - self.start_index


class ResumableDataLoader(DataLoader):
    """A DataLoader over a `ResumableSampler` that knows how far into the epoch it is."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._epoch: int | None = None  # epoch of the iteration in progress
        self._consumed = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.sampler
        self._epoch = int(getattr(sampler, "epoch", 0))
        self._consumed = int(getattr(sampler, "start_index", 0))
        for batch in super().__iter__():
            self._consumed += self.batch_size or 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        sampler = self.sampler
        if self._epoch is None:  # not iterated since construction or restore
            epoch, consumed = int(getattr(sampler, "epoch", 0)), int(getattr(sampler, "start_index", 0))
        else:
            epoch, consumed = self._epoch, self._consumed
        return {"epoch": epoch, "consumed": consumed, "world_size": int(getattr(sampler, "num_replicas", 1))}

    def load_state_dict(self, state: dict[str, int]) -> None:
        sampler = self.sampler
        if not isinstance(sampler, ResumableSampler):
            raise TypeError("ResumableDataLoader.load_state_dict needs a ResumableSampler")
        world = sampler.num_replicas
        total = int(state["consumed"]) * int(state["world_size"])
        if total % world:
            _log.warning(
                "data position: %d samples consumed at world size %d do not split evenly over %d ranks; "
                "resuming %d sample(s) early",
                total,
                state["world_size"],
                world,
                total % world,
            )
        sampler.set_epoch(int(state["epoch"]))
        sampler.start_index = min(total // world, sampler.num_samples)
        self._epoch = None
