"""The checked offload step that does not wait for its verdict: updated during backward, kept or dropped.

With one rank and no clipping, the factor every gradient is multiplied by is known before backward even
when the step is checked (fp16's loss scale, bf16/fp32's `check_grad_overflow`): only the verdict, "the
global gradient norm is finite", comes after it. Without it the update could stream during backward
(step/streamed.py); waiting for it costs the whole offloaded update after backward (1.35x the unchecked
step on the H200 at GPT-2 XL). A speculative step streams anyway and writes what it computes somewhere
the verdict can still take back:

- the new master and moments go to a `Shadow`, a second copy of the host's state. The host step copies
  each cache-sized chunk of the state into the shadow and updates it there (host_adam.py: the state is
  read once and the shadow written once, as an in-place update does); the device step downloads into the
  shadow instead of over the state (device_step.py: the same bytes over PCIe).
- a finite verdict swaps the shadow in (`HostAdam.commit_shadow`: the storage of the master Parameter and
  of the moments, no copy); the old state becomes the next step's shadow.
- a non-finite verdict drops it: the state was never written, the step counts go back (`cancel_step`),
  and the working weights, which the update already overwrote span by span, are written again from the
  masters (`undo_working`): the working weights are always the masters cast to their dtype, so this
  restores them bit for bit. The skip is then exactly the skip of a step that waited: masters, moments,
  step counts, LR scheduler (the engine steps it only on an applied step) and loss scale.

Why a double buffer and not the other two designs: keeping a copy of the old state of what was updated so
far (an undo log) needs the same host memory in the worst case and copies 12 bytes a parameter at every
step; checking each bucket's finiteness as it lands still has to take back the buckets updated before a
bad one, which is the undo log again. With the device step the double buffer adds no PCIe bytes and no
CPU work (the downloads land elsewhere); its price is host memory, 12 pinned bytes a parameter. With the
CPU's step it is not free: the copy into the shadow costs memory traffic (read 12, write-allocate and
write back 12, against the in-place kernel's 12 + 12; measured 1.4-2x the CPU's update alone on the
2-core dev box, where Python's per-chunk cost adds to it). So the plan (plan.py `plan_speculation`) takes
it by default only where the GPU runs the whole step and the host has room for the copy; the CPU's step
speculates only when the internal setting `speculate` says so, and otherwise the checked step waits for
its verdict as before. With several ranks the gradients land after backward and
the update waits for the norm anyway (the verdict comes with the reduction that landing waits for), and
with gradient clipping the factor itself needs the norm, so both keep the order of a waited step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from runtime.offload.io.copies import CopyEngine
from runtime.offload.io.spans import Span, plan_chunks
from runtime.offload.io.targets import Publisher

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""One group's master, exp_avg and exp_avg_sq, flat."""


class Shadow:
    """A second copy of every host group's master and moments, where a speculative step writes."""

    def __init__(self, current: Sequence[State], empty_like: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """`current`: each group's state now; the shadow starts as a copy of it (elements no span
        updates, the alignment padding, then agree in both), each tensor from `empty_like` (flat, and
        pinned where the one it copies is: a copy engine reads it once it is the state)."""
        self._state: list[State] = []
        for group in current:
            p, m, v = (empty_like(t).copy_(t.view(-1)) for t in group)
            self._state.append((p, m, v))

    def state(self, group: int) -> State:
        """Where the speculative step writes `group`'s new master, exp_avg and exp_avg_sq."""
        return self._state[group]

    def swap(self, group: int, current: State) -> State:
        """Hand out `group`'s shadow (the new state) and keep `current` (the old) in its place."""
        new = self._state[group]
        p, m, v = (t.view(-1) for t in current)
        self._state[group] = (p, m, v)
        return new

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for group in self._state for t in group)


def undo_working(
    spans: Sequence[Span],
    masters: Sequence[torch.Tensor],
    publisher: Publisher,
    copies: CopyEngine,
    chunk_elems: int,
) -> None:
    """Write every span's working weights again from its (unchanged) master, after the speculative update
    of a skipped step overwrote them; the caller has ordered this after the update's own writes. The
    copies convert to the working dtype on the way, as the host step's fp32 landing does."""
    for span in spans:
        dst = publisher.piece(span)
        master = masters[span.group].view(-1)
        last = None
        for offset, numel in plan_chunks(span.numel, chunk_elems):
            src = master.narrow(0, span.shard_offset + offset, numel)
            last = copies.to_device(dst.narrow(0, offset, numel), src)
        publisher.uploaded(span, last)
