"""``deepspeed.runtime.pipe.engine``: the pipeline engine under DeepSpeed's path."""

from runtime.pipe.engine import PipelineEngine

__all__ = ["PipelineEngine"]
