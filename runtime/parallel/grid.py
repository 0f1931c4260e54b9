"""The process grid: one `DeviceMesh` with the dims pipe, data and model, and this rank's groups on it.

`ParallelGrid` wraps `init_device_mesh` (so tensor-parallel DTensor plans can use `grid.mesh["model"]`)
and answers DeepSpeed's grid questions (`get_stage_id`, `get_data_parallel_group`, ...). Each part of the
runtime sees one group: ZeRO reduces and partitions over data, pipeline stages exchange activations over
pipe, tensor-parallel layers shard over model. A topology without a model (or pipe) axis gets dim 1 there.
Every rank must build the grid at the same point, since the mesh creates process groups collectively.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from runtime.distributed import current_device
from runtime.parallel.topology import DATA, MODEL, PIPE, ProcessTopology, TopologyError, topology_for

MESH_AXES = (PIPE, DATA, MODEL)


def _mesh_dims(topology: ProcessTopology) -> tuple[int, int, int]:
    """The (pipe, data, model) dims of a topology whose axes are those names in that order (some may be
    missing); any other layout would number ranks differently from the mesh."""
    axes = topology.get_axis_names()
    unknown = [axis for axis in axes if axis not in MESH_AXES]
    ordered = [axis for axis in MESH_AXES if axis in axes]
    if unknown or axes != ordered:
        raise TopologyError(f"the grid needs topology axes among {list(MESH_AXES)} in that order, got {axes}")
    return tuple(topology.get_dim(axis) if axis in axes else 1 for axis in MESH_AXES)  # type: ignore[return-value]


class ParallelGrid:
    """This rank's place in the pipe x data x model grid, with one process group per axis."""

    def __init__(self, topology: ProcessTopology | None = None, *, device_type: str | None = None) -> None:
        world = dist.get_world_size()
        topology = topology or topology_for(world)
        if topology.world_size() != world:
            raise TopologyError(
                f"the topology {topology} has {topology.world_size()} ranks but the job has {world}"
            )
        self._topo = topology
        self.pipe_parallel_size, self.data_parallel_size, self.model_parallel_size = _mesh_dims(topology)
        self.mesh: DeviceMesh = init_device_mesh(
            device_type or current_device().type,
            (self.pipe_parallel_size, self.data_parallel_size, self.model_parallel_size),
            mesh_dim_names=MESH_AXES,
        )
        self.global_rank = dist.get_rank()
        self.world_size = world
        self.stage_id = self.mesh.get_local_rank(PIPE)
        self.data_parallel_id = self.mesh.get_local_rank(DATA)
        self.model_parallel_id = self.mesh.get_local_rank(MODEL)

    def topology(self) -> ProcessTopology:
        return self._topo

    # -- pipeline --------------------------------------------------------------------------------------
    def get_stage_id(self) -> int:
        return self.stage_id

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.pipe_parallel_size - 1

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(PIPE)

    def stage_to_global(self, stage_id: int) -> int:
        """The global rank holding `stage_id` in this rank's pipeline (same data and model coordinates)."""
        if not 0 <= stage_id < self.pipe_parallel_size:
            raise TopologyError(
                f"stage {stage_id} does not exist; there are {self.pipe_parallel_size} stages"
            )
        return self.pipe_ranks()[stage_id]

    def pipe_ranks(self) -> list[int]:
        """The global ranks of this rank's pipeline, by stage."""
        return dist.get_process_group_ranks(self.get_pipe_parallel_group())

    # -- data ------------------------------------------------------------------------------------------
    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(DATA)

    # -- model (tensor) --------------------------------------------------------------------------------
    def get_model_parallel_rank(self) -> int:
        return self.model_parallel_id

    def get_model_parallel_world_size(self) -> int:
        return self.model_parallel_size

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(MODEL)

    # Megatron's mpu spells tensor parallelism "tensor_model_parallel"
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def __repr__(self) -> str:
        return (
            f"ParallelGrid(rank={self.global_rank}, stage={self.stage_id}/{self.pipe_parallel_size}, "
            f"data={self.data_parallel_id}/{self.data_parallel_size}, "
            f"model={self.model_parallel_id}/{self.model_parallel_size})"
        )


# DeepSpeed's name for the same object
PipelineParallelGrid = ParallelGrid

__all__ = ["MESH_AXES", "ParallelGrid", "PipelineParallelGrid"]
