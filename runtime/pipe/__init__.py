"""Pipeline parallelism with DeepSpeed's API (`deepspeed.pipe`): PipelineModule, LayerSpec, TiedLayerSpec,
PipelineEngine, the topology classes; `initialize` builds the engine the way `runtime.initialize` does."""

from __future__ import annotations

from typing import Any

from runtime.parallel.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from runtime.pipe.engine import PipelineEngine
from runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec


def initialize(
    model: PipelineModule,
    config: Any,
    *,
    optimizer: Any = None,
    model_parameters: Any = None,
    lr_scheduler: Any = None,
) -> tuple[PipelineEngine, Any, None, Any]:
    """(engine, optimizer, None, lr_scheduler) for a PipelineModule, like runtime.initialize."""
    engine = PipelineEngine(
        model, config, optimizer=optimizer, model_parameters=model_parameters, lr_scheduler=lr_scheduler
    )
    return engine, engine.optimizer, None, engine.lr_scheduler


__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineEngine",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
    "initialize",
]
