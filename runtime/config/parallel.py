"""The model-parallel sections: `pipeline` and `tensor_parallel`, read as strictly as every other section.

Owns their dataclasses, keys and defaults. A typo gets the reader's "did you mean", a wrong type or a
value out of range names the key path (`tensor_parallel.autotp_size: expected an integer >= 1, got 0`).
The engines read them: `runtime.pipe` the pipeline section (its `stages` and `chunks_per_stage` are
checked against the `PipelineModule`, which is built before any engine sees the config),
`runtime.tensor_parallel` the degree. `load_config` reads `tensor_parallel` too, so a config with
`autotp_size` 1 (DeepSpeed's "no tensor parallelism") loads for the plain engine, as in DeepSpeed.

Pipeline keys: DeepSpeed's stages, partition, seed_layers, activation_checkpoint_interval,
pipe_partitioned, grad_partitioned, use_reentrant (the last three have no effect: activations travel
whole between stages), and ours: schedule, chunks_per_stage. Tensor-parallel keys: autotp_size (alias
tp_size; 0 and 1 mean none, as in DeepSpeed); tp_overlap_comm and tp_grain_size are accepted and have no
effect; DeepSpeed's AutoTP keys for features we lack (partition_config, presets, ...) are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.config.checks import Bool, Choice, Int, Str
from runtime.config.reader import ReadContext, SectionReader

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


@dataclass(frozen=True)
class TensorParallelConfig:
    # ranks each sharded projection is split over (the grid's model dim); 0 and 1: none (DeepSpeed's 0 is
    # "disabled", its default)
    autotp_size: int = 1


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


def read_tensor_parallel(r: SectionReader) -> TensorParallelConfig:
    """The `tensor_parallel` section (absent: degree 1)."""
    r.alias("tp_size", "autotp_size", "DeepSpeed's other name")
    size = r.get("autotp_size", Int(0), 1)
    config = TensorParallelConfig(autotp_size=max(size, 1))
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
    """The `pipeline` section of a config mapping, on its own (what the pipeline engine reads)."""
    return _standalone(read_pipeline, data, "pipeline")


def read_tensor_parallel_section(data: Mapping[str, Any] | None) -> TensorParallelConfig:
    """The `tensor_parallel` section of a config mapping, on its own."""
    return _standalone(read_tensor_parallel, data, "tensor_parallel")


__all__ = [
    "MULTI_CHUNK_SCHEDULES",
    "SCHEDULES",
    "SINGLE_CHUNK_SCHEDULES",
    "PipelineConfig",
    "TensorParallelConfig",
    "read_pipeline",
    "read_pipeline_section",
    "read_tensor_parallel",
    "read_tensor_parallel_section",
]
