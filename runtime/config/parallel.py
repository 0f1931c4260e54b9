"""The `tensor_parallel` section, read as strictly as every other section, and the standalone readers of the
two model-parallel sections (`pipeline` lives in `runtime.config.pipeline`).

Owns `TensorParallelConfig`, its keys and defaults. A typo gets the reader's "did you mean", a wrong type or
a value out of range names the key path (`tensor_parallel.autotp_size: expected an integer >= 0, got -1`).
`load_config` reads both sections into the `Config`; `runtime.parallel.plan` reads the degree from there
(the one place it is read) and the refusals that combine it with other options are in
`runtime.config.combinations`.

Tensor-parallel keys: autotp_size (alias tp_size; 0 and 1 mean none, as in DeepSpeed); tp_overlap_comm and
tp_grain_size are accepted and have no effect; DeepSpeed's AutoTP keys for features we lack
(partition_config, presets, ...) are refused by name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime.config.checks import Bool, Int
from runtime.config.pipeline import (
    MULTI_CHUNK_SCHEDULES,
    SCHEDULES,
    SINGLE_CHUNK_SCHEDULES,
    PipelineConfig,
    read_pipeline,
)
from runtime.config.reader import ReadContext, SectionReader, read_config_file
from runtime.errors import UserError


@dataclass(frozen=True)
class TensorParallelConfig:
    # ranks each sharded projection is split over (the grid's model dim); 0 and 1: none (DeepSpeed's 0 is
    # "disabled", its default)
    autotp_size: int = 1
    # whether the config had the section (a pipeline's topology decides the degree without one)
    explicit: bool = field(default=False, metadata={"internal": True})


# DeepSpeed's tensor_parallel keys for AutoTP features we do not have: refused by name, not as typos
_UNSUPPORTED_TP = {
    "tp": "the nested tp section (use autotp_size)",
    "dtype": "tensor_parallel.dtype (the precision sections decide the dtype)",
    "vocab_parallel_lm_head": "vocabulary-parallel output head",
    "vocab_parallel_ce_backend": "vocabulary-parallel cross entropy",
    "preset_model": "AutoTP model presets",
    "injection_policy_tuple": "AutoTP injection policies",
    "keep_module_on_host": "keep_module_on_host",
    "replace_with_kernel_inject": "inference kernel injection",
    "kernel_inject": "inference kernel injection",
}


def read_tensor_parallel(r: SectionReader) -> TensorParallelConfig:
    """The `tensor_parallel` section (absent: degree 1)."""
    r.alias("tp_size", "autotp_size", "DeepSpeed's other name")
    size = r.get("autotp_size", Int(0), 1)
    config = TensorParallelConfig(autotp_size=max(size, 1), explicit=bool(r.data))
    r.get("tp_overlap_comm", Bool(), False)
    r.get("tp_grain_size", Int(1), 1)
    r.default_only("partition_config", None, "custom AutoTP partition rules (partition_config)")
    r.finish(unsupported=_UNSUPPORTED_TP)
    return config


def _standalone(reader: Any, data: Mapping[str, Any] | None, path: str) -> Any:
    ctx = ReadContext()
    config = reader(SectionReader(data, path, ctx))
    ctx.raise_pending()
    return config


def read_pipeline_section(data: Mapping[str, Any] | None) -> PipelineConfig:
    """The `pipeline` section of a config mapping, on its own."""
    return _standalone(read_pipeline, data, "pipeline")


def read_tensor_parallel_section(data: Mapping[str, Any] | None) -> TensorParallelConfig:
    """The `tensor_parallel` section of a config mapping, on its own (the degree a job needs before its
    config can be loaded: the batch arithmetic counts the data-parallel ranks)."""
    return _standalone(read_tensor_parallel, data, "tensor_parallel")


def tensor_parallel_degree(source: Any) -> int:
    """The autotp_size a config asks for, before it is loaded (a path, a mapping or a loaded `Config`; 1
    without a "tensor_parallel" section): the job's data-parallel size, which the batch arithmetic counts,
    depends on it. The one place the degree is read from a config that is not loaded yet."""
    loaded = getattr(source, "tensor_parallel", None)
    if isinstance(loaded, TensorParallelConfig):
        return loaded.autotp_size
    raw = read_config_file(source) if isinstance(source, (str, os.PathLike)) else source
    if not isinstance(raw, Mapping) or raw.get("tensor_parallel") is None:
        return 1
    return read_tensor_parallel_section(raw["tensor_parallel"]).autotp_size


class TopologyError(UserError, ValueError):
    """Degrees that do not lay out the job's ranks, or a coordinate outside them (a ValueError as before,
    and a UserError: one line)."""

    hint = (
        "choose pipeline and tensor-parallel degrees whose product divides the number of ranks "
        "(the data-parallel degree is what is left)"
    )


def check_grid_degrees(world_size: int, *, pp: int = 1, tp: int = 1) -> None:
    """The pipeline and tensor-parallel degrees must lay out `world_size` ranks (data is what is left)."""
    for name, degree in (("pipeline stages", pp), ("tensor-parallel degree", tp)):
        if degree < 1:
            raise TopologyError(f"the {name} must be at least 1, got {degree}")
    if world_size % (pp * tp) != 0:
        raise TopologyError(
            f"{pp} pipeline stages x tensor-parallel degree {tp} = {pp * tp} ranks per replica does not "
            f"divide the world size {world_size}"
        )


__all__ = [
    "MULTI_CHUNK_SCHEDULES",
    "SCHEDULES",
    "SINGLE_CHUNK_SCHEDULES",
    "PipelineConfig",
    "TensorParallelConfig",
    "TopologyError",
    "check_grid_degrees",
    "read_pipeline",
    "read_pipeline_section",
    "read_tensor_parallel",
    "read_tensor_parallel_section",
    "tensor_parallel_degree",
]
