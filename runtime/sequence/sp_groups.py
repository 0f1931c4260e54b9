"""The sequence-parallel process groups: a ("data", "sequence") device mesh and DeepSpeed's mpu over it.

Ranks are laid out as DeepSpeed lays them out for Ulysses: consecutive ranks share one sequence
(``[0 .. sp-1]`` one sequence group, ``[sp .. 2sp-1]`` the next, ...), and the ranks holding the same
sequence shard of different sequences form a data group (``{0, sp, 2sp, ...}``). ``SequenceLayout`` is that
rule as a pure value; ``init_sequence_parallel`` builds the groups on a torch ``DeviceMesh`` of shape
``(world / sp, sp)`` with dims named ``("data", "sequence")`` (it works on gloo as on NCCL) and returns a
``SequenceParallelGroups``: the object DeepSpeed's ``register_with_transformers`` returns as ``mpu``, with
its method names (``get_sequence_parallel_*``, ``get_sequence_data_parallel_*``, the model-parallel
aliases), plus ``get_data_parallel_*`` for the data axis alone.

What the engine does with it (runtime.parallel.plan, ``initialize(mpu=<these groups>)``): gradients are
SUMMED over the sequence group (each rank back-propagates only its share of the sequence's mean loss, see
runtime.sequence.ulysses_data.reduce_sequence_loss) and AVERAGED over the data group. DeepSpeed does both
in one reduction over the sequence-data group (the whole sp x dp world) divided by dp; ZeRO partitions over
that same group.

The most recent groups built in this process are ``current_sequence_groups()`` (DeepSpeed keeps them in
module globals; HF Trainer reads them back through ``deepspeed.utils.groups``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from runtime.errors import UserError

__all__ = [
    "SequenceLayout",
    "SequenceParallelGroups",
    "current_sequence_groups",
    "init_sequence_parallel",
    "sequence_layout",
]

_CURRENT: SequenceParallelGroups | None = None


@dataclass(frozen=True)
class SequenceLayout:
    """Which ranks share a sequence and which share a data shard: ``world`` ranks, ``sp`` per sequence."""

    world: int
    sp: int

    @property
    def dp(self) -> int:
        return self.world // self.sp

    def sequence_ranks(self, rank: int) -> list[int]:
        """The ranks that hold the other shards of ``rank``'s sequence (``rank`` among them)."""
        first = rank - rank % self.sp
        return list(range(first, first + self.sp))

    def data_ranks(self, rank: int) -> list[int]:
        """The ranks that hold the same sequence shard as ``rank`` in the other sequences."""
        return list(range(rank % self.sp, self.world, self.sp))


def sequence_layout(world: int, sp: int, key: str = "sequence_parallel_size") -> SequenceLayout:
    """The layout, or a UserError naming ``key`` when ``sp`` is not a positive divisor of ``world``."""
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise UserError(
            f"{key}={sp!r}: expected a positive integer", hint="set it to a divisor of the world size"
        )
    if world % sp:
        raise UserError(
            f"{key}={sp} does not divide the world size {world}",
            hint=f"launch a multiple of {sp} ranks, or set {key} to a divisor of {world}",
        )
    return SequenceLayout(world=world, sp=sp)


class SequenceParallelGroups:
    """DeepSpeed's Ulysses ``mpu``: the sequence group, the data group and the two together, for this rank."""

    def __init__(self, layout: SequenceLayout, mesh: Any) -> None:
        self.layout = layout
        self.mesh = mesh
        self._sequence = mesh["sequence"].get_group()
        self._data = mesh["data"].get_group()
        self._world = dist.group.WORLD  # the sequence-data group: sp x dp is the whole world

    # the sequence axis
    def get_sequence_parallel_group(self) -> Any:
        return self._sequence

    def get_sequence_parallel_world_size(self) -> int:
        return self.layout.sp

    def get_sequence_parallel_rank(self) -> int:
        return dist.get_rank(self._sequence)

    # sequence and data together (DeepSpeed reduces gradients and partitions ZeRO state over it)
    def get_sequence_data_parallel_group(self) -> Any:
        return self._world

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.layout.world

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank()

    # the data axis alone (ours: DeepSpeed's sp mpu has no such names)
    def get_data_parallel_group(self) -> Any:
        return self._data

    def get_data_parallel_world_size(self) -> int:
        return self.layout.dp

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._data)

    # DeepSpeed aliases model parallelism to the sequence axis (its only axis beside data)
    get_model_parallel_rank = get_sequence_parallel_rank
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_group = get_sequence_parallel_group

    def __repr__(self) -> str:
        return f"SequenceParallelGroups(sp={self.layout.sp}, dp={self.layout.dp})"


def init_sequence_parallel(sp: int, key: str = "sequence_parallel_size") -> SequenceParallelGroups:
    """Build the ("data", "sequence") mesh for ``sp`` ranks per sequence over the initialized world (every
    rank calls it) and make it the current groups. A UserError naming ``key`` when ``sp`` does not divide
    the world."""
    if not dist.is_initialized():
        raise UserError(
            f"{key}={sp}: sequence parallelism needs the process group",
            hint="call deepspeed.init_distributed() (or launch with dslaunch) first",
        )
    layout = sequence_layout(dist.get_world_size(), sp, key)
    # imported here: DeviceMesh pulls in torch.distributed.tensor, which a run without sp never needs
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (layout.dp, layout.sp), mesh_dim_names=("data", "sequence"))
    global _CURRENT
    _CURRENT = SequenceParallelGroups(layout, mesh)
    return _CURRENT


def current_sequence_groups() -> SequenceParallelGroups | None:
    """The groups the last ``init_sequence_parallel`` in this process built, or None."""
    return _CURRENT
