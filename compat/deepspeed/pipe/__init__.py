"""``deepspeed.pipe``: pipeline parallelism's names over dslaunch's ``runtime.pipe``."""

from runtime.parallel.grid import ParallelGrid as PipelineParallelGrid
from runtime.parallel.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from runtime.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineModule",
    "PipelineParallelGrid",
    "ProcessTopology",
    "TiedLayerSpec",
]
