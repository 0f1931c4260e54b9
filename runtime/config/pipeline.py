"""The `pipeline` section and the pure schedule checks: which torch schedule runs a module of `stages`
stages x `chunks` chunks for `micro_batches` per batch, or why none can.

Owns `PipelineConfig`, its keys and defaults, and `check_schedule`. The section is read as strictly as
every other (a typo gets "did you mean", a bad value its key path). The module's own arguments
(`PipelineModule(num_stages=..., chunks_per_stage=...)`) decide stages and chunks: the module is built
before the config is loaded, so the section's values for those are checked against it, never applied.

Keys: DeepSpeed's stages, partition, seed_layers, activation_checkpoint_interval, pipe_partitioned,
grad_partitioned, use_reentrant (the last three have no effect: activations travel whole between stages),
and ours: schedule, chunks_per_stage.

Schedules: "1f1b" (the default with one chunk per stage; "gpipe" when there are fewer micro-batches than
stages, which torch's 1F1B refuses and which is the same schedule then) and "gpipe" run one chunk per
stage; "interleaved_1f1b" (the default with several chunks per stage) and "looped_bfs" run the chunks of a
`PipelineModule(..., chunks_per_stage=v)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.config.checks import Bool, Choice, Int, Str
from runtime.config.reader import ConfigError, SectionReader

SINGLE_CHUNK_SCHEDULES = ("1f1b", "gpipe")
MULTI_CHUNK_SCHEDULES = ("interleaved_1f1b", "looped_bfs")
SCHEDULES = SINGLE_CHUNK_SCHEDULES + MULTI_CHUNK_SCHEDULES


@dataclass(frozen=True)
class PipelineConfig:
    stages: int | None = None  # None ("auto"): whatever the module was built with
    schedule: str | None = None  # None: "1f1b" for one chunk per stage, "interleaved_1f1b" for several
    chunks_per_stage: int | None = None  # None ("auto"): whatever the module was built with
    activation_checkpoint_interval: int | None = None  # None: the module's own setting

    def schedule_for(self, chunks_per_stage: int) -> str:
        """The schedule to run for a module holding `chunks_per_stage` chunks on each stage."""
        if self.schedule is not None:
            return self.schedule
        return "1f1b" if chunks_per_stage == 1 else "interleaved_1f1b"


def is_pipeline_model(model: Any) -> bool:
    """Whether `model` is a pipeline (runtime.pipe.PipelineModule marks itself), without importing it:
    the config package sits below the model side."""
    return bool(getattr(type(model), "is_pipeline_module", False))


def _auto(r: SectionReader, key: str, lo: int = 1) -> int | None:
    """An integer >= lo, or None for "auto" / absent (the module decides)."""
    if r.data.get(key) == "auto":
        r.has(key)
        return None
    return r.get(key, Int(lo, nullable=True), None)


def read_pipeline(r: SectionReader) -> PipelineConfig:
    """The `pipeline` section (absent or empty: every value from the module)."""
    schedule = r.get("schedule", Choice(SCHEDULES, nullable=True), None)
    config = PipelineConfig(
        stages=_auto(r, "stages"),
        schedule=schedule,
        chunks_per_stage=_auto(r, "chunks_per_stage"),
        activation_checkpoint_interval=_auto(r, "activation_checkpoint_interval", lo=0),
    )
    r.get("partition", Str(), "parameters")  # the module's partition_method decides; the key is DeepSpeed's
    r.get("seed_layers", Bool(), False)  # likewise PipelineModule(seed_layers=...)
    for key, default in (("pipe_partitioned", True), ("grad_partitioned", True), ("use_reentrant", True)):
        r.get(key, Bool(), default)
    r.finish()
    return config


def interleaved_rounds(micro_batches: int, stages: int) -> int:
    """How many rounds torch's ScheduleInterleaved1F1B cuts the micro-batches into (it needs
    micro_batches to be a multiple of this): one round per `stages` micro-batches, at least one."""
    return max(1, micro_batches // stages)


def check_schedule(pipe_cfg: PipelineConfig, stages: int, chunks: int, micro_batches: int) -> str:
    """The schedule to run for a module of `stages` stages x `chunks` chunks and `micro_batches` per
    batch; a combination that cannot run is refused, naming the numbers."""
    if pipe_cfg.chunks_per_stage is not None and pipe_cfg.chunks_per_stage != chunks:
        raise ConfigError(
            "pipeline.chunks_per_stage",
            f"{pipe_cfg.chunks_per_stage} but the PipelineModule was built with {chunks} chunks per stage: "
            f"pass PipelineModule(..., chunks_per_stage={pipe_cfg.chunks_per_stage}) or remove the key",
        )
    schedule = pipe_cfg.schedule_for(chunks)
    if schedule == "1f1b" and micro_batches < stages:
        if pipe_cfg.schedule is None:  # the default: GPipe is the same schedule when every micro-batch
            return "gpipe"  # fits in flight at once (DeepSpeed runs fewer micro-batches than stages too)
        raise ConfigError(
            "gradient_accumulation_steps",
            f"{micro_batches} micro-batches, but pipeline.schedule '1f1b' needs at least one per stage "
            f"({stages})",
            hint=f"set gradient_accumulation_steps to {stages} or more, or use the schedule 'gpipe'",
        )
    if chunks > 1 and schedule not in MULTI_CHUNK_SCHEDULES:
        raise ConfigError(
            "pipeline.schedule",
            f"{schedule!r} runs one chunk per stage but the PipelineModule holds {chunks} chunks per "
            f"stage; use one of {list(MULTI_CHUNK_SCHEDULES)}",
        )
    if chunks == 1 and schedule in MULTI_CHUNK_SCHEDULES:
        raise ConfigError(
            "pipeline.schedule",
            f"{schedule!r} interleaves several chunks per stage but the PipelineModule holds one; build "
            "it with PipelineModule(..., chunks_per_stage=2) or use '1f1b'",
        )
    if schedule == "interleaved_1f1b":
        rounds = interleaved_rounds(micro_batches, stages)
        if micro_batches % rounds:
            fits = [m for m in range(1, 2 * micro_batches) if m % interleaved_rounds(m, stages) == 0]
            below = max(m for m in fits if m < micro_batches)
            above = min(m for m in fits if m > micro_batches)
            raise ConfigError(
                "gradient_accumulation_steps",
                f"{micro_batches} is not a multiple of {rounds}: pipeline.schedule 'interleaved_1f1b' "
                f"with {stages} stages runs the micro-batches in rounds of max(1, {micro_batches} // "
                f"{stages}) = {rounds}",
                hint=f"use {below} or {above} micro-batches (gradient_accumulation_steps)",
            )
    return schedule


__all__ = [
    "MULTI_CHUNK_SCHEDULES",
    "SCHEDULES",
    "SINGLE_CHUNK_SCHEDULES",
    "PipelineConfig",
    "check_schedule",
    "interleaved_rounds",
    "is_pipeline_model",
    "read_pipeline",
]
