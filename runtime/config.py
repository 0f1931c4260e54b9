"""The DeepSpeed-style training config as typed, frozen dataclasses.

`load_config(source, world_size=..., model=...)` reads a JSON/YAML path or a mapping, checks every key
(unknown keys are errors with a suggestion, DeepSpeed features we lack are refused by name, wrong types
name the key path and the expected type), completes the batch arithmetic, resolves or refuses "auto",
and returns a `Config`. Every `ConfigError` message starts with the key path.

Defaults follow DeepSpeed except where noted: `gradient_clipping` defaults to 0.0 (no clipping) as in
DeepSpeed <= 0.16; DeepSpeed 0.19.8 defaults to 1.0, so set it explicitly when comparing the two.
The optimizer/scheduler sections are checked in `runtime.config_optim`, `zero_optimization` in
`runtime.config_zero`, tensorboard/csv_monitor/wandb in `runtime.config_monitor` (their dataclasses are
re-exported here), and the batch arithmetic is done by `runtime.config_batch`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch

from runtime.config_batch import resolve_batch
from runtime.config_checks import Bool, Choice, Float, Int
from runtime.config_monitor import CSVMonitorConfig, TensorBoardConfig, WandbConfig, read_monitor, read_wandb
from runtime.config_optim import OptimizerConfig, SchedulerConfig, read_optimizer, read_scheduler
from runtime.config_reader import (
    AutoRefused,
    ConfigError,
    FrozenDict,
    ReadContext,
    SectionReader,
    freeze,
    read_config_file,
    thaw,
)
from runtime.config_zero import OffloadConfig, ZeroConfig, model_hidden_size, read_zero

__all__ = [
    "ActivationCheckpointingConfig",
    "BF16Config",
    "CSVMonitorConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "FP16Config",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "ZeroConfig",
    "load_config",
    "model_hidden_size",
    "render_config",
]


@dataclass(frozen=True)
class FP16Config:
    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = 0.0  # 0 = dynamic loss scaling; > 0 = this static scale
    initial_scale_power: int = 16  # dynamic scaling starts at 2**initial_scale_power
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0


@dataclass(frozen=True)
class BF16Config:
    """The bf16 section. Its two step-skipping keys also govern fp32 runs (fp32 has no section of its own);
    fp16 runs skip through the loss scaler instead (the fp16 section)."""

    enabled: bool = False
    # Decide every step on the global gradient norm: a non-finite one skips the step on every rank
    # (DeepSpeed's key; DeepSpeed defaults to false and applies such steps, which turns every weight into
    # NaN). False also lets the offloaded step start during backward (runtime.offload.streamed).
    check_grad_overflow: bool = True
    # Stop with NonfiniteGradientsError after this many consecutive skipped steps; 0 = never stop (ours:
    # DeepSpeed has no such key).
    max_consecutive_nonfinite_steps: int = 10


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass(frozen=True)
class CheckpointConfig:
    tag_validation: str = "WARN"  # "WARN" | "IGNORE" | "FAIL": what to do when ranks save different tags
    use_node_local_storage: bool = False


@dataclass(frozen=True)
class Config:
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    steps_per_print: int = 10  # 0 = never
    gradient_clipping: float = 0.0  # 0 = no clipping (DeepSpeed 0.19.8 defaults to 1.0)
    wall_clock_breakdown: bool = False
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    communication_data_type: str | None = None  # "fp32" | "fp16" | "bf16"; None = the gradients' dtype
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    zero_allow_untested_optimizer: bool = False
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    csv_monitor: CSVMonitorConfig = field(default_factory=CSVMonitorConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    memory_breakdown: bool = False
    dataloader_drop_last: bool = False
    world_size: int = 1  # the data-parallel world size the batch arithmetic used
    raw: Mapping[str, Any] = field(default_factory=FrozenDict)  # the resolved config, every key explicit
    notes: tuple[str, ...] = ()  # aliases mapped, keys ignored, "auto" resolved: log these once on rank 0

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of the working (forward/backward) weights."""
        if self.bf16.enabled:
            return torch.bfloat16
        if self.fp16.enabled:
            return torch.float16
        return torch.float32

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain dicts and lists."""
        return thaw(self.raw)

    def get(self, key: str, default: Any = None) -> Any:
        """A top-level key of the resolved config: DeepSpeed's ``engine.config`` is a dict, and Trainer
        reads it with ``engine.config.get("zero_optimization", {})``."""
        return self.raw.get(key, default)


# DeepSpeed top-level keys for features dslaunch does not have (yet), or not for this model: the value names
# the feature. ("pipeline" and "tensor_parallel" are read by runtime.pipe / runtime.tensor_parallel, whose
# engines runtime.initialize picks for a PipelineModule or an autotp_size above 1.)
_UNSUPPORTED_TOP_LEVEL = {
    "amp": "apex AMP",
    "pipeline": "a pipeline section for a model that is not a PipelineModule (runtime.pipe.PipelineModule, "
    "deepspeed.pipe.PipelineModule: pipeline parallelism)",
    "tensor_parallel": "tensor_parallel with autotp_size 1 (no tensor parallelism: leave the section out)",
    "sequence_parallel_size": "sequence parallelism",
    "compression_training": "compression training",
    "compression": "compression",
    "elasticity": "elastic training",
    "autotuning": "autotuning",
    "flops_profiler": "flops profiler",
    "comms_logger": "communication logger",
    "comet": "Comet monitor",
    "aio": "async I/O for NVMe offload",
    "sparse_attention": "sparse attention",
    "data_efficiency": "data efficiency library",
    "curriculum_learning": "curriculum learning",
    "eigenvalue": "eigenvalue computation",
    "progressive_layer_drop": "progressive layer drop",
    "compile": "deepspeed.compile",
    "nebula": "Nebula checkpointing",
    "quantize_training": "quantization-aware training",
    "weight_quantization": "weight quantization",
    "hybrid_engine": "hybrid engine (RLHF)",
    "data_types": "data_types (gradient accumulation dtype)",
    "torch_autocast": "torch_autocast section",
}


def _never_if_inf(check: Any) -> Any:
    """Accelerate writes steps_per_print = float("inf") for "never"; that is 0 here."""

    def read(path: str, value: Any) -> Any:
        return 0 if isinstance(value, float) and value == float("inf") else check(path, value)

    return read


def _read_fp16(r: SectionReader, model: torch.nn.Module | None) -> FP16Config:
    cfg = FP16Config(
        enabled=r.get("enabled", Bool(), False, auto=lambda: _enabled_from_model(model, torch.float16)),
        auto_cast=r.get("auto_cast", Bool(), False),
        loss_scale=r.get("loss_scale", Float(0.0), 0.0),
        initial_scale_power=r.get("initial_scale_power", Int(0, 64), 16),
        loss_scale_window=r.get("loss_scale_window", Int(1), 1000),
        hysteresis=r.get("hysteresis", Int(1), 2),
        consecutive_hysteresis=r.get("consecutive_hysteresis", Bool(), False),
        min_loss_scale=r.get("min_loss_scale", Float(0.0, lo_open=True), 1.0),
    )
    r.default_only("fp16_master_weights_and_grads", False, "fp16 master weights")
    r.finish()
    return cfg


def _read_bf16(r: SectionReader, model: torch.nn.Module | None) -> BF16Config:
    cfg = BF16Config(
        enabled=r.get("enabled", Bool(), False, auto=lambda: _enabled_from_model(model, torch.bfloat16)),
        check_grad_overflow=r.get("check_grad_overflow", Bool(), True),
        max_consecutive_nonfinite_steps=r.get("max_consecutive_nonfinite_steps", Int(0), 10),
    )
    r.ignored("immediate_grad_update", False, "gradients are reduced during backward, applied at the step")
    r.default_only("bf16_master_weights_and_grads", False, "bf16 master weights")
    r.default_only("bf16_optimizer_states", False, "bf16 optimizer states")
    r.finish()
    return cfg


def _enabled_from_model(model: torch.nn.Module | None, dtype: torch.dtype) -> bool:
    """ "enabled": "auto" means "match the model": on when its floating-point weights are in `dtype`."""
    if model is None:
        raise AutoRefused(
            "needs the model to see its dtype (HF Trainer fills it from --fp16/--bf16); set true/false"
        )
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return dtypes == {dtype}


def _read_activation_checkpointing(r: SectionReader) -> ActivationCheckpointingConfig:
    cfg = ActivationCheckpointingConfig(
        partition_activations=r.get("partition_activations", Bool(), False),
        cpu_checkpointing=r.get("cpu_checkpointing", Bool(), False),
        contiguous_memory_optimization=r.get("contiguous_memory_optimization", Bool(), False),
        number_checkpoints=r.get("number_checkpoints", Int(1, nullable=True), None),
        synchronize_checkpoint_boundary=r.get("synchronize_checkpoint_boundary", Bool(), False),
        profile=r.get("profile", Bool(), False),
    )
    r.finish()
    return cfg


def _read_checkpoint(r: SectionReader) -> CheckpointConfig:
    cfg = CheckpointConfig(
        tag_validation=r.get("tag_validation", Choice(("WARN", "IGNORE", "FAIL")), "WARN"),
        use_node_local_storage=r.get("use_node_local_storage", Bool(), False),
    )
    r.ignored("load_universal", False, "dslaunch checkpoints reshard on load without a universal conversion")
    parallel_write = r.section("parallel_write")
    parallel_write.default_only("pipeline_stage", False, "pipeline-stage parallel checkpoint writes")
    parallel_write.finish()
    r.finish(unsupported={"writer": "checkpoint writer selection"})
    return cfg


# ---------------------------------------------------------------------------------------------------------
# The whole config


def load_config(
    source: str | os.PathLike | Mapping[str, Any],
    *,
    world_size: int,
    model: torch.nn.Module | None = None,
    auto_values: Mapping[str, Any] | None = None,
) -> Config:
    """Read and check a DeepSpeed-style config.

    source: a .json/.yaml/.yml path or a mapping. world_size: the data-parallel world size (the caller must
    know it; it is never assumed to be 1). model: used to resolve "auto" values derived from the model
    (hidden-size-based ZeRO-3 bucket sizes, fp16/bf16 "enabled"). auto_values: values for other "auto"
    keys by key path, e.g. {"optimizer.params.lr": 3e-4}, the way a trainer integration fills them.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError("world_size", f"expected a positive integer, got {world_size!r}")
    data = read_config_file(source) if isinstance(source, (str, os.PathLike)) else source
    ctx = ReadContext(auto_values=dict(auto_values or {}))
    top = SectionReader(data, "", ctx)

    if isinstance(top.data.get("zero_optimization"), bool):
        legacy = top.data["zero_optimization"]
        ctx.note(f"zero_optimization: {legacy} read as {{'stage': {int(legacy)}}} (legacy DeepSpeed form)")
        top.data = {**top.data, "zero_optimization": {"stage": int(legacy)}}
    if "bf16" in top.data and "bfloat16" in top.data:
        raise ConfigError("bfloat16", 'is another name for "bf16"; set only one of them')
    top.alias("bfloat16", "bf16", "DeepSpeed alias")

    fp16 = _read_fp16(top.section("fp16"), model)
    bf16 = _read_bf16(top.section("bf16"), model)
    zero = read_zero(top.section("zero_optimization"), model)
    # A null section means "none", as in DeepSpeed (a client optimizer / scheduler, or none at all).
    has_optimizer = top.has("optimizer") and top.data["optimizer"] is not None
    has_scheduler = top.has("scheduler") and top.data["scheduler"] is not None
    optimizer = read_optimizer(top.section("optimizer")) if has_optimizer else None
    scheduler = read_scheduler(top.section("scheduler")) if has_scheduler else None
    simple = {
        "steps_per_print": top.get("steps_per_print", _never_if_inf(Int(0, nullable=True)), 10) or 0,
        "gradient_clipping": top.get("gradient_clipping", Float(0.0), 0.0),
        "wall_clock_breakdown": top.get("wall_clock_breakdown", Bool(), False),
        "prescale_gradients": top.get("prescale_gradients", Bool(), False),
        "gradient_predivide_factor": top.get("gradient_predivide_factor", Float(0.0, lo_open=True), 1.0),
        "communication_data_type": top.get(
            "communication_data_type", Choice(("fp32", "fp16", "bf16"), True), None
        ),
        "zero_allow_untested_optimizer": top.get("zero_allow_untested_optimizer", Bool(), False),
        "memory_breakdown": top.get("memory_breakdown", Bool(), False),
        "dataloader_drop_last": top.get("dataloader_drop_last", Bool(), False),
    }
    sections = {
        "activation_checkpointing": _read_activation_checkpointing(top.section("activation_checkpointing")),
        "tensorboard": read_monitor(top.section("tensorboard"), TensorBoardConfig),
        "csv_monitor": read_monitor(top.section("csv_monitor"), CSVMonitorConfig),
        "wandb": read_wandb(top.section("wandb")),
        "checkpoint": _read_checkpoint(top.section("checkpoint")),
    }
    top.ignored("zero_force_ds_cpu_optimizer", True, "any torch optimizer runs on offloaded CPU shards")
    top.ignored("dump_state", False, "no state dump")
    top.default_only("sparse_gradients", False, "sparse gradients")
    for batch_key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        top.has(batch_key)  # read later by resolve_batch; declared now so finish() knows them
    top.finish(unsupported=_UNSUPPORTED_TOP_LEVEL)
    ctx.raise_pending()  # typos first: they often explain the errors that would follow

    train_batch_size, micro, gas = resolve_batch(top, world_size)
    ctx.raise_pending()

    if fp16.enabled and bf16.enabled:
        raise ConfigError("fp16.enabled", "fp16 and bf16 cannot both be enabled; keep one of them")
    _check_optimizer_with_zero(optimizer, zero, simple["zero_allow_untested_optimizer"])

    config = Config(
        train_batch_size=train_batch_size,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=gas,
        fp16=fp16,
        bf16=bf16,
        optimizer=optimizer,
        scheduler=scheduler,
        zero_optimization=zero,
        world_size=world_size,
        notes=tuple(ctx.notes),
        **simple,
        **sections,
    )
    return _with_raw(config)


def _check_optimizer_with_zero(
    optimizer: OptimizerConfig | None, zero: ZeroConfig, allow_untested: bool
) -> None:
    if optimizer is None or zero.stage == 0 or allow_untested:
        return
    if optimizer.type == "Lamb":
        raise ConfigError(
            "optimizer.type",
            f"Lamb computes one trust ratio per parameter tensor, but ZeRO stage {zero.stage} steps the "
            "optimizer "
            "on flat shards, so the ratios differ from an unsharded run; set "
            '"zero_allow_untested_optimizer": true to accept that, or use stage 0',
        )


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        # internal fields (tuning that tests set, runtime/offload/settings.py) are not config keys
        keys = [f.name for f in fields(value) if not f.metadata.get("internal")]
        return {name: _plain(getattr(value, name)) for name in keys}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _with_raw(config: Config) -> Config:
    raw = {k: v for k, v in _plain(config).items() if k not in ("raw", "notes", "world_size")}
    object.__setattr__(config, "raw", freeze(raw))
    return config


def render_config(config: Config) -> str:
    """The resolved config as indented JSON, followed by the notes, for the run log."""
    text = json.dumps(thaw(config.raw), indent=2, sort_keys=True)
    dtype = str(config.param_dtype).removeprefix("torch.")
    header = f"dslaunch config (world_size={config.world_size}, param_dtype={dtype})"
    lines = [header, text]
    if config.notes:
        lines.append("notes:")
        lines.extend(f"  - {note}" for note in config.notes)
    return "\n".join(lines)
