"""Collectives on flat buffers for one data-parallel group, with byte counters and backend fallbacks.

`Comm` wraps a process group with the three operations ZeRO needs, on 1-D tensors:
all_reduce (sum, in place), reduce_scatter (sum; rank r receives the r-th equal chunk) and all_gather
(rank r's chunk lands at the r-th position), plus broadcast (ZeRO-3's GatheredParameters). Each returns
a `Pending` handle; with async_op the caller overlaps the collective with compute and calls `wait()`
before reading the result. Outputs may alias the input (rank r's chunk of it): NCCL and gloo both run
that in place, which saves a copy and a buffer.

Backends without reduce_scatter (older gloo) get it emulated as an all-reduce of the input followed by a
copy of this rank's chunk; the input buffer is then overwritten, so callers must treat a reduce_scatter
input as scratch. `CommCounter` records calls and bytes per operation (the size of the full buffer: input
for reduce_scatter, output for all_gather, the tensor for all_reduce), so tests and benchmarks can check
communication volume against the ZeRO paper (all-reduce moves 2x, reduce-scatter and all-gather 1x each
per rank in a ring, times (N-1)/N).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch >= 2.13 renamed the flat collectives; older versions (the GPU machine runs 2.11) have the old names.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommCounter:
    """Calls and bytes per collective since the last `reset()`."""

    calls: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)

    def record(self, op: str, nbytes: int) -> None:
        self.calls[op] += 1
        self.bytes[op] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


class Pending:
    """An in-flight collective; `wait()` blocks (or orders the stream, on CUDA) and runs the finish step."""

    __slots__ = ("_after", "_work")

    def __init__(self, work: dist.Work | None = None, after: Callable[[], object] | None = None) -> None:
        self._work = work
        self._after = after

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._after is not None:
            after, self._after = self._after, None
            after()


DONE = Pending()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype


class Comm:
    """Flat collectives over one process group (the default group unless given)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        emulate_reduce_scatter: bool | None = None,
    ) -> None:
        """emulate_reduce_scatter: True forces the all-reduce fallback, None decides by backend."""
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.counter = CommCounter()
        self._native_reduce_scatter = not emulate_reduce_scatter

    def all_reduce(self, tensor: torch.Tensor, *, async_op: bool = False) -> Pending:
        """Sum `tensor` over ranks, in place."""
        if self.world_size == 1:
            return DONE
        self.counter.record("all_reduce", tensor.numel() * tensor.element_size())
        work = dist.all_reduce(tensor, group=self.group, async_op=async_op)
        return Pending(work)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Pending:
        """Sum `input` over ranks; rank r gets chunk r in `output`. `input` is scratch afterwards."""
        chunk = output.numel()
        if input.numel() != chunk * self.world_size:
            raise ValueError(
                f"reduce_scatter: input has {input.numel()} elements, expected output ({chunk}) x world "
                f"size ({self.world_size})"
            )
        mine = input.narrow(0, self.rank * chunk, chunk)
        if self.world_size == 1:
            if not _same_memory(output, mine):
                output.copy_(mine)
            return DONE
        self.counter.record("reduce_scatter", input.numel() * input.element_size())
        if self._native_reduce_scatter:
            try:
                work = _reduce_scatter_flat(output, input, group=self.group, async_op=async_op)
                return Pending(work)
            except (RuntimeError, NotImplementedError) as error:
                if "not supported" not in str(error).lower() and "not implemented" not in str(error).lower():
                    raise
                self._native_reduce_scatter = False  # this backend lacks it; every rank learns the same way
        self.counter.record("emulated_reduce_scatter", input.numel() * input.element_size())
        work = dist.all_reduce(input, group=self.group, async_op=async_op)
        after = None if _same_memory(output, mine) else (lambda: output.copy_(mine))
        pending = Pending(work, after)
        if not async_op:
            pending.wait()
        return pending

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Pending:
        """Rank r's `input` lands in chunk r of `output`; `input` may be that chunk itself."""
        chunk = input.numel()
        if output.numel() != chunk * self.world_size:
            raise ValueError(
                f"all_gather: output has {output.numel()} elements, expected input ({chunk}) x world "
                f"size ({self.world_size})"
            )
        if self.world_size == 1:
            if not _same_memory(output, input):
                output.copy_(input)
            return DONE
        self.counter.record("all_gather", output.numel() * output.element_size())
        work = _all_gather_flat(output, input, group=self.group, async_op=async_op)
        return Pending(work)

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Pending:
        """Rank `src`'s `tensor` overwrites every other rank's, in place (`src` is a rank of this group)."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: source rank {src} is outside the group of {self.world_size} ranks")
        if self.world_size == 1:
            return DONE
        self.counter.record("broadcast", tensor.numel() * tensor.element_size())
        root = dist.get_global_rank(self.group, src) if self.group is not None else src
        work = dist.broadcast(tensor, root, group=self.group, async_op=async_op)
        return Pending(work)

    def count(self, flag: bool, device: torch.device) -> int:
        """How many ranks passed True (one all-reduce of one number; every rank must call it)."""
        if self.world_size == 1:
            return int(flag)
        votes = torch.tensor([1.0 if flag else 0.0], device=device)
        self.all_reduce(votes)
        return round(votes.item())

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
