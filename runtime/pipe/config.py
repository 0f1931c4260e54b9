"""The pipeline's own inputs checked: `PipelineModule`'s arguments (`check_module_arguments`) and
`PipelineError`, the one error type for a pipeline input that cannot run (a `UserError`: one line and exit
code 2).

The config's "pipeline" section and the schedule checks are `runtime.config.pipeline`'s (re-exported
here under their old names); the refusals that combine the pipeline with other options are in
`runtime.config.combinations`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from runtime.config.parallel import read_pipeline_section
from runtime.config.pipeline import (
    MULTI_CHUNK_SCHEDULES,
    SCHEDULES,
    SINGLE_CHUNK_SCHEDULES,
    PipelineConfig,
    check_schedule,
    interleaved_rounds,
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
