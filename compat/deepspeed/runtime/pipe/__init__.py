"""``deepspeed.runtime.pipe``: DeepSpeed's module paths for the pipeline engine, module and topology."""

from deepspeed.runtime.pipe import engine, module, topology
from runtime.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "engine", "module", "topology"]
