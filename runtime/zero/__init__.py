"""ZeRO stages as strategy objects behind one small protocol.

The engine talks to a `ZeroStage` and never branches on the stage number itself:

    begin_backward(boundary) -> autograd -> end_backward(boundary)   # gradients reduced as they appear
    grad_pieces()        # this rank's reduced gradients per group, in master-shard order
    write_back()         # updated master shards -> working weights (all-gathered for stages 1 and 2)
    zero_grad()

`build_zero_stage` picks the strategy: stage 0 and 1 keep full gradients (`ReplicatedGradStage`), stage 2
keeps a gradient shard (`ShardedGradStage`); with one rank every stage is the replicated one, since a
shard is the whole buffer. Stage 3 (parameters sharded per module group) will be another strategy over
the same `partition` math and `Comm`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from runtime.comm import Comm
from runtime.zero.flat import FlatGroup, flatten_group
from runtime.zero.partition import FlatLayout, plan_flat_layout
from runtime.zero.replicated import GradientViewsReplaced, ReplicatedGradStage
from runtime.zero.sharded import ShardedGradStage

__all__ = [
    "FlatGroup",
    "FlatLayout",
    "GradientViewsReplaced",
    "ReplicatedGradStage",
    "ShardedGradStage",
    "ZeroStage",
    "build_zero_stage",
    "flatten_group",
    "plan_flat_layout",
    "shards_optimizer_state",
]


class ZeroStage(Protocol):
    stage: int
    groups: list[FlatGroup]

    @property
    def grads_are_sharded(self) -> bool:
        """True when each rank's gradients cover only its shard (the norm then needs an all-reduce)."""
        ...

    def begin_backward(self, *, boundary: bool) -> None: ...

    def end_backward(self, *, boundary: bool) -> None: ...

    def grad_pieces(self) -> list[list[torch.Tensor]]: ...

    def write_back(self) -> None: ...

    def zero_grad(self) -> None: ...

    def grad_bytes(self) -> int: ...

    def buffer_bytes(self) -> int: ...

    def close(self) -> None: ...


def shards_optimizer_state(stage: int) -> bool:
    """Whether master weights and optimizer state are split across ranks at this stage."""
    return stage >= 1


def build_zero_stage(
    stage: int,
    groups: Sequence[FlatGroup],
    comm: Comm,
    *,
    registration: dict[nn.Parameter, int],
    overlap_comm: bool = True,
    pre_reduce_scale: float = 1.0,
    reduce_dtype: torch.dtype | None = None,
) -> ZeroStage:
    """The strategy for `stage` (0, 1 or 2) over already flattened groups."""
    if stage not in (0, 1, 2):
        raise NotImplementedError(
            f"zero_optimization.stage {stage} is not implemented yet; stages 0, 1 and 2 are available"
        )
    kwargs = {
        "registration": registration,
        "overlap_comm": overlap_comm,
        "pre_reduce_scale": pre_reduce_scale,
        "reduce_dtype": reduce_dtype,
    }
    if stage == 2 and comm.world_size > 1:
        return ShardedGradStage(groups, comm, **kwargs)
    return ReplicatedGradStage(stage, groups, comm, **kwargs)
