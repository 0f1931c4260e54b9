"""The config's "pipeline" section, read here until the typed config (runtime.config) takes it over.

DeepSpeed's keys: stages, partition, seed_layers, activation_checkpoint_interval, pipe_partitioned,
grad_partitioned, use_reentrant; plus ours: schedule ("1f1b", the default, or "gpipe"). The module's
own arguments (PipelineModule) decide stages, partition and seeding; the section's values for those are
checked against the module, not applied to it, since the module is built before the engine sees the
config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SCHEDULES = ("1f1b", "gpipe")
_KEYS = {
    "stages",
    "partition",
    "seed_layers",
    "activation_checkpoint_interval",
    "pipe_partitioned",
    "grad_partitioned",
    "use_reentrant",
    "schedule",
}


@dataclass(frozen=True)
class PipelineConfig:
    stages: int | None = None  # None ("auto"): whatever the module was built with
    schedule: str = "1f1b"  # the order of micro-batch forwards and backwards on each stage
    activation_checkpoint_interval: int | None = None  # None: the module's own setting

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline.schedule: {self.schedule!r} is not one of {list(SCHEDULES)}")
        if self.stages is not None and self.stages < 1:
            raise ValueError(f"pipeline.stages: must be at least 1 or 'auto', got {self.stages}")


def read_pipeline_config(section: Mapping[str, Any] | None) -> PipelineConfig:
    """Check the section's keys and read the ones the engine uses; the others (partitioning of
    activations and gradients, reentrant checkpointing) are accepted for compatibility and have no effect
    here: activations travel whole between stages."""
    section = dict(section or {})
    unknown = sorted(set(section) - _KEYS)
    if unknown:
        raise ValueError(f"pipeline: unknown keys {unknown}; known keys are {sorted(_KEYS)}")
    stages = section.get("stages", "auto")
    interval = section.get("activation_checkpoint_interval")
    return PipelineConfig(
        stages=None if stages == "auto" else int(stages),
        schedule=str(section.get("schedule", "1f1b")).lower(),
        activation_checkpoint_interval=None if interval is None else int(interval),
    )


__all__ = ["SCHEDULES", "PipelineConfig", "read_pipeline_config"]
