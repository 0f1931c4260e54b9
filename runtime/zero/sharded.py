"""ZeRO stage 2: gradients are reduce-scattered in buckets during backward; each rank keeps only its shard.

When a parameter's gradient is final (post-accumulate-grad hook), it is copied into its bucket's staging
buffer and the parameter's `.grad` is dropped, so a full gradient never exists. When every parameter of
a bucket has arrived, the bucket is reduce-scattered in place (rank r's chunk of the staging buffer
receives the sum) while backward continues; the chunk is then written into (first micro-step) or added
to (later micro-steps) this rank's persistent gradient shard. At most `max_in_flight` staging buffers
wait on the network at a time, which bounds the extra memory to a few buckets.

Gradient accumulation therefore communicates on every micro-step (as DeepSpeed's stage 2 does); stage 1
communicates only at the boundary but keeps full gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from runtime.comm import Comm
from runtime.zero.common import HookedStage, InFlight, StageOptions, gather_working
from runtime.zero.flat import FlatGroup


class ShardedGradStage(HookedStage):
    """Stage 2 with more than one rank (one rank runs `ReplicatedGradStage`)."""

    stage = 2

    def __init__(
        self, groups: Sequence[FlatGroup], comm: Comm, options: StageOptions, *, max_in_flight: int = 2
    ) -> None:
        super().__init__(groups, comm, options)
        self.max_in_flight = max(1, max_in_flight)
        self.shards = [
            torch.zeros(group.layout.shard_numel, dtype=group.working.dtype, device=group.working.device)
            for group in self.groups
        ]
        self._staging: dict[int, torch.Tensor] = {}  # tracker position -> staging buffer being filled
        self._has_grads = False  # the shards hold gradients of this accumulation window
        self._slot_of = {
            param: slot
            for group in self.groups
            for param, slot in zip(group.params, group.layout.slots, strict=True)
        }
        self._position_of = {key: i for i, key in enumerate(self.tracker.order)}
        for group in self.groups:
            for param in group.params:
                param.grad = None
        self._register_hooks()

    @property
    def grads_are_sharded(self) -> bool:
        return True

    def begin_backward(self, *, boundary: bool) -> None:
        self.check_owned("backward")
        self.tracker.reset()

    def _staging_buffer(self, position: int) -> torch.Tensor:
        buffer = self._staging.get(position)
        if buffer is None:
            g, b = self.tracker.order[position]
            group = self.groups[g]
            dtype = group.reduce_dtype or self.reduce_dtype or group.working.dtype
            # zeros: padding and parameters without a gradient this pass must contribute nothing
            buffer = torch.zeros(group.layout.buckets[b].numel, dtype=dtype, device=group.working.device)
            self._staging[position] = buffer
        return buffer

    def _on_grad(self, param: nn.Parameter) -> None:
        position = self.tracker.position(param)
        g, b = self.tracker.order[position]
        bucket = self.groups[g].layout.buckets[b]
        slot = self._slot_of[param]
        buffer = self._staging_buffer(position)
        grad = param.grad
        if grad is not None:
            buffer.narrow(0, slot.offset - bucket.start, slot.numel).copy_(grad.reshape(-1))
            param.grad = None
        self.tracker.mark(param)

    def _launch(self, group: FlatGroup, bucket_index: int) -> None:
        bucket = group.layout.buckets[bucket_index]
        position = self._position_of[(group.index, bucket_index)]
        buffer = self._staging_buffer(position)
        del self._staging[position]
        if self.pre_reduce_scale != 1.0:
            buffer.mul_(self.pre_reduce_scale)
        chunk = buffer.narrow(0, self.comm.rank * bucket.piece_numel, bucket.piece_numel)
        mine = self.shards[group.index].narrow(0, bucket.shard_offset, bucket.piece_numel)
        pending = self.comm.reduce_scatter(chunk, buffer, async_op=True)
        after = (lambda: mine.add_(chunk)) if self._has_grads else (lambda: mine.copy_(chunk))
        while len(self._in_flight) >= self.max_in_flight:
            self._in_flight.pop(0).finish()
        self._track(InFlight(pending, buffer, after))

    def end_backward(self, *, boundary: bool) -> None:
        self.tracker.flush()
        self._finish_all()
        self._has_grads = True

    def grad_pieces(self) -> list[list[torch.Tensor]]:
        self.check_owned("step")
        return [[shard] for shard in self.shards]

    def write_back(self) -> None:
        gather_working(self.groups, self.comm)

    def _free_grads(self) -> None:
        self.shards = [shard.new_empty(0) for shard in self.shards]
        self._staging.clear()

    def zero_grad(self) -> None:
        # The next micro-step overwrites the shards instead of adding to them: no kernel needed.
        self._has_grads = False

    def grad_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.shards)

    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._staging.values())
