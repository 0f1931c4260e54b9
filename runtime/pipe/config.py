"""The config's "pipeline" section, read here until the typed config (runtime.config) takes it over.

DeepSpeed's keys: stages, partition, seed_layers, activation_checkpoint_interval, pipe_partitioned,
grad_partitioned, use_reentrant; plus ours: schedule and chunks_per_stage. The module's own arguments
(PipelineModule) decide stages, chunks, partition and seeding; the section's values for those are checked
against the module, not applied to it, since the module is built before the engine sees the config.

Schedules: "1f1b" (the default with one chunk per stage) and "gpipe" run one chunk per stage;
"interleaved_1f1b" (the default with several chunks per stage) and "looped_bfs" run the chunks of a
`PipelineModule(..., chunks_per_stage=v)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SINGLE_CHUNK_SCHEDULES = ("1f1b", "gpipe")
MULTI_CHUNK_SCHEDULES = ("interleaved_1f1b", "looped_bfs")
SCHEDULES = SINGLE_CHUNK_SCHEDULES + MULTI_CHUNK_SCHEDULES
_KEYS = {
    "stages",
    "partition",
    "seed_layers",
    "activation_checkpoint_interval",
    "pipe_partitioned",
    "grad_partitioned",
    "use_reentrant",
    "schedule",
    "chunks_per_stage",
}


@dataclass(frozen=True)
class PipelineConfig:
    stages: int | None = None  # None ("auto"): whatever the module was built with
    schedule: str | None = None  # None: "1f1b" for one chunk per stage, "interleaved_1f1b" for several
    chunks_per_stage: int | None = None  # None ("auto"): whatever the module was built with
    activation_checkpoint_interval: int | None = None  # None: the module's own setting

    def __post_init__(self) -> None:
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline.schedule: {self.schedule!r} is not one of {list(SCHEDULES)}")
        if self.stages is not None and self.stages < 1:
            raise ValueError(f"pipeline.stages: must be at least 1 or 'auto', got {self.stages}")
        if self.chunks_per_stage is not None and self.chunks_per_stage < 1:
            raise ValueError(
                f"pipeline.chunks_per_stage: must be at least 1 or 'auto', got {self.chunks_per_stage}"
            )

    def schedule_for(self, chunks_per_stage: int) -> str:
        """The schedule to run for a module holding `chunks_per_stage` chunks on each stage."""
        if self.schedule is not None:
            return self.schedule
        return "1f1b" if chunks_per_stage == 1 else "interleaved_1f1b"


def interleaved_rounds(micro_batches: int, stages: int) -> int:
    """How many rounds torch's ScheduleInterleaved1F1B cuts the micro-batches into (it needs
    micro_batches to be a multiple of this): one round per `stages` micro-batches, at least one."""
    return max(1, micro_batches // stages)


def check_schedule(pipe_cfg: PipelineConfig, stages: int, chunks: int, micro_batches: int) -> str:
    """The schedule to run for a module of `stages` stages x `chunks` chunks and `micro_batches` per
    batch; a combination that cannot run is refused, naming the numbers."""
    if pipe_cfg.chunks_per_stage is not None and pipe_cfg.chunks_per_stage != chunks:
        raise ValueError(
            f"pipeline.chunks_per_stage is {pipe_cfg.chunks_per_stage} but the PipelineModule was built "
            f"with {chunks} chunks per stage: pass PipelineModule(..., "
            f"chunks_per_stage={pipe_cfg.chunks_per_stage})"
        )
    schedule = pipe_cfg.schedule_for(chunks)
    if chunks > 1 and schedule not in MULTI_CHUNK_SCHEDULES:
        raise ValueError(
            f"pipeline.schedule {schedule!r} runs one chunk per stage but the PipelineModule holds "
            f"{chunks} chunks per stage; use one of {list(MULTI_CHUNK_SCHEDULES)}"
        )
    if chunks == 1 and schedule in MULTI_CHUNK_SCHEDULES:
        raise ValueError(
            f"pipeline.schedule {schedule!r} interleaves several chunks per stage but the PipelineModule "
            "holds one; build it with PipelineModule(..., chunks_per_stage=2) or use '1f1b'"
        )
    if schedule == "interleaved_1f1b":
        rounds = interleaved_rounds(micro_batches, stages)
        if micro_batches % rounds:
            fits = [m for m in range(1, 2 * micro_batches) if m % interleaved_rounds(m, stages) == 0]
            below = max(m for m in fits if m < micro_batches)
            above = min(m for m in fits if m > micro_batches)
            raise ValueError(
                f"pipeline.schedule 'interleaved_1f1b' with {stages} stages runs the micro-batches in "
                f"rounds (max(1, {micro_batches} // {stages}) = {rounds} here), so "
                f"gradient_accumulation_steps must be a multiple of {rounds}; got {micro_batches} "
                f"(use {below} or {above})"
            )
    return schedule


def _auto_int(value: Any) -> int | None:
    return None if value is None or value == "auto" else int(value)


def read_pipeline_config(section: Mapping[str, Any] | None) -> PipelineConfig:
    """Check the section's keys and read the ones the engine uses; the others (partitioning of
    activations and gradients, reentrant checkpointing) are accepted for compatibility and have no effect
    here: activations travel whole between stages."""
    section = dict(section or {})
    unknown = sorted(set(section) - _KEYS)
    if unknown:
        raise ValueError(f"pipeline: unknown keys {unknown}; known keys are {sorted(_KEYS)}")
    schedule = section.get("schedule")
    return PipelineConfig(
        stages=_auto_int(section.get("stages", "auto")),
        schedule=None if schedule is None else str(schedule).lower(),
        chunks_per_stage=_auto_int(section.get("chunks_per_stage", "auto")),
        activation_checkpoint_interval=_auto_int(section.get("activation_checkpoint_interval")),
    )


__all__ = [
    "MULTI_CHUNK_SCHEDULES",
    "SCHEDULES",
    "SINGLE_CHUNK_SCHEDULES",
    "PipelineConfig",
    "check_schedule",
    "interleaved_rounds",
    "read_pipeline_config",
]
