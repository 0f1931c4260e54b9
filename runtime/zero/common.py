"""What the ZeRO stages share: gradient hooks, in-flight collectives, and gathering updated weights.

Every stage registers one post-accumulate-grad hook per parameter (only when there is something to
communicate), hands finished parameters to a `BucketTracker`, and keeps the collectives it launched as
`InFlight` records until the end of backward. Stages 1 and 2 write their updated master shard into the
working buffer and all-gather it bucket by bucket (`gather_working`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from runtime.comm import Comm, Pending
from runtime.zero.buckets import BucketTracker, bucket_order
from runtime.zero.flat import FlatGroup
from runtime.zero.gathered import ResidentGroups
from runtime.zero.offload_split import OffloadSplit
from runtime.zero.takeover import TakeOver

if TYPE_CHECKING:
    from runtime.zero.stage3_hooks import GatherScheduler
    from runtime.zero.stage3_unit import ShardedUnit


@dataclass
class InFlight:
    """A launched collective, the buffer it reads or writes, and what to do once it is done."""

    pending: Pending
    buffer: torch.Tensor | None = None  # kept alive until the collective finishes
    after: Callable[[], object] | None = None  # its result is not used

    def finish(self) -> None:
        self.pending.wait()
        if self.after is not None:
            self.after()
        self.buffer = None


@dataclass(frozen=True)
class StageOptions:
    """What the builder (runtime.zero.build_zero_stage) hands every hooked stage besides its groups."""

    registration: dict[nn.Parameter, int]  # parameter -> its index in model.parameters()
    overlap_comm: bool = True
    pre_reduce_scale: float = 1.0
    reduce_dtype: torch.dtype | None = None
    offload_split: OffloadSplit | None = None  # partial optimizer offload: which groups go to the host
    trains: bool = True  # False: an engine without an optimizer, which keeps no gradient buffers


class HookedStage:
    """Base of the stage strategies whose parameters are always whole (stages 0-2, and stage 3 with one
    rank): hooks, bucket tracking and in-flight bookkeeping."""

    stage: int = -1

    def __init__(self, groups: Sequence[FlatGroup], comm: Comm, options: StageOptions) -> None:
        self.groups = list(groups)
        self.comm = comm
        self.overlap_comm = options.overlap_comm
        self.pre_reduce_scale = options.pre_reduce_scale
        self.reduce_dtype = options.reduce_dtype
        self.offload_split = options.offload_split
        self.tracker = BucketTracker(
            self.groups, bucket_order(self.groups, options.registration), self._launch
        )
        self._in_flight: list[InFlight] = []
        self._hooks: list[RemovableHandle] = []
        # GatheredParameters(modifier_rank=...) on these always-whole parameters must still reach the
        # masters; the parameters' registry holds it weakly, so the stage keeps it
        self.resident = ResidentGroups(self.groups, comm)
        self.resident.on_hand_over = self._taken_over
        self.taken_over: TakeOver | None = None  # another engine built over this model later took it
        self.on_taken_over: Callable[[], None] | None = None  # the engine's, to free what it alone reads

    @property
    def params_sharded(self) -> bool:
        return False

    @property
    def units(self) -> Sequence[ShardedUnit]:
        return ()

    @property
    def schedule(self) -> GatherScheduler | None:
        return None  # every weight stays whole: no module hooks gather anything

    def host_param_bytes(self) -> int:
        return 0

    # -- subclass interface -------------------------------------------------------------------------
    def _launch(self, group: FlatGroup, bucket: int) -> None:
        raise NotImplementedError

    def _on_grad(self, param: nn.Parameter) -> None:
        raise NotImplementedError

    # -- shared machinery ---------------------------------------------------------------------------
    def _register_hooks(self) -> None:
        for group in self.groups:
            for param in group.params:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad))

    def _track(self, record: InFlight) -> None:
        self._in_flight.append(record)
        if not self.overlap_comm:
            self._finish_all()

    def _finish_all(self) -> None:
        records, self._in_flight = self._in_flight, []
        for record in records:
            record.finish()

    def _prepare_for_reduce(self, data: torch.Tensor, group: FlatGroup) -> torch.Tensor:
        """The tensor to put on the wire for `data`: pre-divided and in the reduce dtype (the group's own
        where it has one: torch_autocast.lower_precision_safe_modules)."""
        if self.pre_reduce_scale != 1.0:
            data.mul_(self.pre_reduce_scale)
        dtype = group.reduce_dtype or self.reduce_dtype
        if dtype is not None and dtype != data.dtype:
            return data.to(dtype)
        return data

    def _taken_over(self, new_stage: int) -> None:
        """Another engine took the model over (ResidentGroups.hand_over): this stage's gradient hooks come
        off, so the new engine's backward sees only its own (an old stage-2 hook would take each `.grad`
        into this stage's buffers); its backward and step are refused from now on (`check_owned`)."""
        self.close()
        self._free_grads()
        self.taken_over = TakeOver(self.stage, new_stage)
        if self.on_taken_over is not None:
            self.on_taken_over()

    def _free_grads(self) -> None:
        """Free the gradient buffers (taken over: nothing reads them again)."""

    def check_owned(self, what: str) -> None:
        """Raise ModelTakenOver when another engine took this stage's model over."""
        if self.taken_over is not None:
            raise self.taken_over.error(what)

    def close(self) -> None:
        """Remove the hooks (the model then trains without this engine's gradient handling)."""
        self._finish_all()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def write_back(self) -> None:
        raise NotImplementedError

    def param_bytes(self) -> int:
        """Working weights held by this rank (the full flat buffers)."""
        return sum(g.working.numel() * g.working.element_size() for g in self.groups)


def gather_working(groups: Sequence[FlatGroup], comm: Comm) -> None:
    """Copy each updated master shard into the working buffer and all-gather every bucket in place."""
    launched: list[Pending] = []
    for group in groups:
        group.copy_master_to_working()
        if comm.world_size == 1 or group.layout.world_size == 1:  # one rank, or unsharded (no optimizer)
            continue
        for bucket in group.layout.buckets:
            full = group.bucket_view(group.working, bucket)
            launched.append(comm.all_gather(full, group.piece(group.working, bucket), async_op=True))
    for pending in launched:
        pending.wait()
