"""``deepspeed.runtime.pipe.module``: the pipeline module and its layer specs under DeepSpeed's path."""

from runtime.pipe.config import PipelineError
from runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec"]
