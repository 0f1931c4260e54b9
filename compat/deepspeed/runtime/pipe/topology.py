"""``deepspeed.runtime.pipe.topology``: the process topologies and the grid under DeepSpeed's path."""

from runtime.parallel.grid import ParallelGrid as PipelineParallelGrid
from runtime.parallel.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = [
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "ProcessTopology",
]
