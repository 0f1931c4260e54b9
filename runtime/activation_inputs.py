"""How runtime.activation_checkpointing keeps a checkpointed block's input for backward: `PackedInput`,
the kept form (flat data, or its piece when partitioned over the model-parallel group, or a host copy),
and `InputSlots`, the preallocated slots of `contiguous_memory_optimization`.
"""

from __future__ import annotations

import weakref

import torch

from runtime.comm import Comm
from runtime.distributed import accelerator
from runtime.sequence.host_stash import HostCopy

__all__ = ["InputSlots", "PackedInput"]


class InputSlots:
    """``slots`` preallocated copies per (numel, dtype, device): one contiguous buffer each."""

    def __init__(self, slots: int | None) -> None:
        self.slots = slots or 1
        self._pools: dict[tuple[int, torch.dtype, torch.device], tuple[torch.Tensor, list[int]]] = {}

    def store(self, data: torch.Tensor, owner: object) -> torch.Tensor:
        """Copy flat `data` into a free slot; the slot is free again when `owner` is garbage."""
        key = (data.numel(), data.dtype, data.device)
        pool = self._pools.get(key)
        if pool is None:
            pin = data.device.type == "cpu" and accelerator() == "cuda"
            buffer = torch.empty(
                (self.slots, data.numel()), dtype=data.dtype, device=data.device, pin_memory=pin
            )
            pool = self._pools[key] = (buffer, list(range(self.slots - 1, -1, -1)))
        buffer, free = pool
        if not free:
            raise RuntimeError(
                f"activation checkpointing: more than number_checkpoints={self.slots} checkpointed inputs "
                f"of {data.numel()} {str(data.dtype).removeprefix('torch.')} elements are alive at once; "
                "set activation_checkpointing.number_checkpoints to at least the number of checkpointed "
                "calls per forward (or call runtime.activation_checkpointing.reset() after forwards "
                "without backward)"
            )
        index = free.pop()
        weakref.finalize(owner, free.append, index)
        slot = buffer[index]
        slot.copy_(data, non_blocking=True)
        return slot


class PackedInput:
    """A checkpointed input as kept for backward: flat data (a piece of it when partitioned)."""

    __slots__ = ("__weakref__", "comm", "data", "device", "numel", "shape", "stashed")

    def __init__(self, shape: torch.Size, device: torch.device, numel: int) -> None:
        self.shape = shape
        self.device = device
        self.numel = numel
        self.comm: Comm | None = None  # the model-parallel group it was split over, if partitioned
        self.data: torch.Tensor | None = None
        self.stashed: HostCopy | None = None  # kept in host memory (cpu_checkpointing)
