"""The model-parallel unit ("mpu"): a Megatron-style object that names this rank's groups.

A Megatron-LM or Megatron-DeepSpeed script builds its own tensor-parallel layers and hands the runtime an
object with methods for its process groups (``initialize(mpu=...)``, ``checkpointing.configure(mpu_)``).
The runtime asks it for two groups: the data-parallel group, which ZeRO partitions and reduces over, and
the model-parallel group, over which the gradient norm is summed. `resolve_mpu` reads them once, checks
them and returns them as `MpuGroups`; nothing else in the runtime calls the mpu.

Spellings accepted (Megatron renamed its methods over the years; DeepSpeed accepts both):
- data: ``get_data_parallel_group``, ``get_data_parallel_world_size``, ``get_data_parallel_rank``;
- model: ``get_tensor_model_parallel_{group,world_size,rank}`` when the mpu has them, else
  ``get_model_parallel_{group,world_size,rank}``;
- pipeline: ``get_pipeline_model_parallel_world_size`` or ``get_pipe_parallel_world_size`` when present.
  It must be 1: a pipeline goes through ``runtime.pipe.PipelineModule``, not through an mpu.

Our `ParallelGrid` has these methods, so a grid is an mpu too.

Parameters: Megatron marks the weights it splits over the model group with ``tensor_model_parallel =
True`` (older DeepSpeed code: ``model_parallel = True``). A parameter without the mark is whole on every
model rank (layer norms, replicated biases), so the norm counts it once, not once per model rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from runtime.errors import UserError

__all__ = [
    "MpuError",
    "MpuGroups",
    "is_model_parallel_parameter",
    "model_parallel_names",
    "read_mpu",
    "resolve_mpu",
    "tensor_parallel_rank",
]

_DATA = ("get_data_parallel_group", "get_data_parallel_world_size", "get_data_parallel_rank")
_TENSOR = (
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_world_size",
    "get_tensor_model_parallel_rank",
)
_MODEL = ("get_model_parallel_group", "get_model_parallel_world_size", "get_model_parallel_rank")
_PIPE = ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")


class MpuError(UserError, ValueError):
    """The model-parallel unit lacks a method, or its groups do not fit the job."""

    hint = (
        "pass a Megatron-style mpu (get_data_parallel_group/_world_size/_rank and "
        "get_model_parallel_group/_world_size/_rank, or the get_tensor_model_parallel_* names), or a "
        "runtime.parallel.ParallelGrid"
    )


@dataclass(frozen=True)
class MpuGroups:
    """This rank's data- and model-parallel groups, as an mpu reported and `resolve_mpu` checked them."""

    data_group: Any  # torch ProcessGroup
    data_size: int
    data_rank: int
    model_group: Any  # torch ProcessGroup
    model_size: int
    model_rank: int

    def describe(self) -> str:
        return f"model-parallel size {self.model_size} x data-parallel size {self.data_size}"


def model_parallel_names(mpu: Any) -> tuple[str, str, str]:
    """The tensor-parallel spelling when the mpu has it (newer Megatron: there, get_model_parallel_*
    means tensor x pipeline), else the older one."""
    return _TENSOR if all(callable(getattr(mpu, name, None)) for name in _TENSOR) else _MODEL


def tensor_parallel_rank(mpu: Any) -> int:
    """This rank's position in its model-parallel (tensor) group, by the mpu's own spelling."""
    return int(getattr(mpu, model_parallel_names(mpu)[2])())


def is_model_parallel_parameter(param: torch.Tensor) -> bool:
    """Whether a parameter is split over the model group (Megatron's and DeepSpeed's marks)."""
    return bool(getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False))


def read_mpu(mpu: Any) -> MpuGroups:
    """An mpu's groups as it reports them, unchecked (`resolve_mpu` checks them for an engine; a pipeline's
    grid answers here too, for deepspeed.utils.groups)."""
    data_group, data_size, data_rank = (getattr(mpu, name)() for name in _DATA)
    model_group, model_size, model_rank = (getattr(mpu, name)() for name in model_parallel_names(mpu))
    data = (data_group, int(data_size), int(data_rank))
    return MpuGroups(*data, model_group, int(model_size), int(model_rank))


def resolve_mpu(mpu: Any, world_size: int | None = None) -> MpuGroups:
    """Read and check an mpu's groups: every method present, the group objects of the sizes and ranks
    the mpu states, no pipeline, and model size x data size = the world size."""
    kind = type(mpu).__name__
    model_names = model_parallel_names(mpu)
    missing = [name for name in (*_DATA, *model_names) if not callable(getattr(mpu, name, None))]
    if missing:
        raise MpuError(f"the mpu ({kind}) has no {', '.join(f'{name}()' for name in missing)}")
    for name in _PIPE:
        if callable(getattr(mpu, name, None)) and int(getattr(mpu, name)()) > 1:
            raise MpuError(
                f"the mpu ({kind}) has {int(getattr(mpu, name)())} pipeline stages ({name}()); initialize"
                "(mpu=...) trains tensor x data parallelism only",
                hint="build a runtime.pipe.PipelineModule with a PipeModelDataParallelTopology for pipelines",
            )
    groups = read_mpu(mpu)
    data_group, model_group = groups.data_group, groups.model_group
    for what, group, size, rank, names in (
        ("data-parallel", data_group, groups.data_size, groups.data_rank, _DATA),
        ("model-parallel", model_group, groups.model_size, groups.model_rank, model_names),
    ):
        _check_group(kind, what, group, size, rank, names)
    world = dist.get_world_size() if world_size is None else world_size
    if groups.model_size * groups.data_size != world:
        raise MpuError(
            f"the mpu ({kind}) describes {groups.model_size} model-parallel x {groups.data_size} "
            f"data-parallel = {groups.model_size * groups.data_size} ranks, but the job has {world}"
        )
    return groups


def _check_group(kind: str, what: str, group: Any, size: int, rank: int, names: tuple[str, ...]) -> None:
    if size < 1 or not 0 <= rank < size:
        raise MpuError(f"the mpu ({kind}) reports {what} rank {rank} of size {size} ({names[2]}, {names[1]})")
    actual = dist.get_world_size(group)
    if actual != size:
        raise MpuError(
            f"the mpu ({kind}): {names[0]}() is a group of {actual} ranks, but {names[1]}() says {size}"
        )
    if dist.get_rank(group) != rank:
        raise MpuError(
            f"the mpu ({kind}): this process is rank {dist.get_rank(group)} of {names[0]}(), but "
            f"{names[2]}() says {rank}"
        )
