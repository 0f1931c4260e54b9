"""Process topology and grid shared by pipeline, tensor and data parallelism (DESIGN.md "one grid")."""

from runtime.parallel.grid import MESH_AXES, ParallelGrid, PipelineParallelGrid
from runtime.parallel.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    TopologyError,
    topology_for,
)

__all__ = [
    "MESH_AXES",
    "ParallelGrid",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "ProcessTopology",
    "TopologyError",
    "topology_for",
]
