"""``deepspeed.runtime.pipe.module``: the pipeline module and its layer specs under DeepSpeed's path."""

from runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
