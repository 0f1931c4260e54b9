"""The pipeline's inputs checked against each other: the config's "pipeline" section (read strictly by
`runtime.config.parallel`) with the `PipelineModule` and the batch, and `PipelineError`, the one error
type for a pipeline input that cannot run (a `UserError`: one line and exit code 2).

The module's own arguments
(PipelineModule) decide stages, chunks, partition and seeding; the section's values for those are checked
against the module, not applied to it, since the module is built before the engine sees the config.

Schedules: "1f1b" (the default with one chunk per stage; "gpipe" when there are fewer micro-batches
than stages, which torch's 1F1B refuses and which is the same schedule then) and "gpipe" run one chunk per
stage;
"interleaved_1f1b" (the default with several chunks per stage) and "looped_bfs" run the chunks of a
`PipelineModule(..., chunks_per_stage=v)`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from runtime.config import ConfigError
from runtime.config.parallel import (
    MULTI_CHUNK_SCHEDULES,
    SCHEDULES,
    SINGLE_CHUNK_SCHEDULES,
    PipelineConfig,
    read_pipeline_section,
)
from runtime.errors import UserError


class PipelineError(UserError, ValueError):
    """A pipeline input that cannot run: the PipelineModule's arguments, its layers, the data iterator
    (DeepSpeed's name for the pipeline's errors; a ValueError as before, so old handlers still catch it)."""

    hint = (
        "fix the PipelineModule(...) arguments or the data the message names; the README's pipeline "
        "section shows a working setup"
    )


def describe_object(value: Any) -> str:
    """A value for a message, the same on every rank: a function or class by its dotted name, anything
    else as "type repr" without memory addresses (which differ per process and keep the launcher from
    folding the ranks' identical errors into one line)."""
    name = getattr(value, "__qualname__" if isinstance(value, type) else "__name__", None)
    if isinstance(name, str) and callable(value):
        module = getattr(value, "__module__", None) or getattr(
            getattr(value, "__self__", None), "__name__", ""
        )
        kind = "class" if isinstance(value, type) else "function"
        return f"{kind} {module + '.' if module else ''}{name}"
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))
    return f"{type(value).__name__} {text[:80]}"


def _int_argument(name: str, value: Any, low: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise PipelineError(
            f"PipelineModule({name}={value!r}): expected an integer >= {low}, got {describe_object(value)}"
        )


def check_module_arguments(arguments: Mapping[str, Any]) -> None:
    """PipelineModule's scalar arguments, by type and range, before anything is built: each wrong one
    is a PipelineError naming the argument (the same on every rank, so no rank waits for another)."""
    _int_argument("num_stages", arguments["num_stages"], 1, optional=True)
    _int_argument("activation_checkpoint_interval", arguments["activation_checkpoint_interval"], 0)
    _int_argument("chunks_per_stage", arguments["chunks_per_stage"], 1)
    _int_argument("base_seed", arguments["base_seed"], 0)
    if not isinstance(arguments["partition_method"], str):
        raise PipelineError(
            f"PipelineModule(partition_method=...): expected a string ('parameters', 'uniform' or "
            f"'type:REGEX'), got {describe_object(arguments['partition_method'])}"
        )
    for name in ("loss_fn", "seed_fn"):
        value = arguments[name]
        if value is not None and not callable(value):
            raise PipelineError(
                f"PipelineModule({name}=...): expected a function (or None), got {describe_object(value)}",
                hint="loss_fn(outputs, labels) -> a scalar tensor, e.g. torch.nn.functional.cross_entropy"
                if name == "loss_fn"
                else "seed_fn(seed) seeds the generators before each layer is built",
            )


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


def read_pipeline_config(section: Mapping[str, Any] | None) -> PipelineConfig:
    """The config's "pipeline" section, strictly (a typo gets "did you mean", a bad value its key path)."""
    return read_pipeline_section(section)


__all__ = [
    "MULTI_CHUNK_SCHEDULES",
    "SCHEDULES",
    "SINGLE_CHUNK_SCHEDULES",
    "PipelineConfig",
    "PipelineError",
    "check_schedule",
    "interleaved_rounds",
    "read_pipeline_config",
]
