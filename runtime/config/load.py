"""The whole config: the top-level `Config`, `load_config` that builds it, and `render_config` for the log.

`load_config(source, world_size=..., model=...)` reads a JSON/YAML path or a mapping, checks every key
(unknown keys are errors with a suggestion, DeepSpeed features we lack are refused by name, wrong types
name the key path and the expected type), completes the batch arithmetic, resolves or refuses "auto",
and returns a `Config`. Every `ConfigError` message starts with the key path.

This module owns the top-level keys, the DeepSpeed top-level sections we refuse by name, the checks that
need two sections at once (fp16 with bf16, the optimizer with the ZeRO stage) and the resolved config
(`Config.raw`). Each section is read by its own module: `zero_optimization` in `runtime.config.zero`,
optimizer/scheduler in `runtime.config.optim`, the small sections in `runtime.config.sections`, and the
batch arithmetic in `runtime.config.batch`.

Defaults follow DeepSpeed except where noted: `gradient_clipping` defaults to 0.0 (no clipping) as in
DeepSpeed <= 0.16; DeepSpeed 0.19.8 defaults to 1.0, so set it explicitly when comparing the two.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch

from runtime.config.batch import resolve_batch
from runtime.config.checks import Bool, Choice, Float, Int
from runtime.config.compile import CompileConfig, read_compile
from runtime.config.fp8 import FP8Config, read_fp8
from runtime.config.low_precision import TorchAutocastConfig, check_low_precision, read_torch_autocast
from runtime.config.optim import OptimizerConfig, SchedulerConfig, read_optimizer, read_scheduler
from runtime.config.parallel import TensorParallelConfig, read_tensor_parallel
from runtime.config.pipeline import PipelineConfig, is_pipeline_model, read_pipeline
from runtime.config.reader import (
    ConfigError,
    FrozenDict,
    ReadContext,
    SectionReader,
    freeze,
    read_config_file,
    thaw,
)
from runtime.config.sections import (
    ActivationCheckpointingConfig,
    BF16Config,
    CheckpointConfig,
    CSVMonitorConfig,
    FP16Config,
    TensorBoardConfig,
    WandbConfig,
    read_activation_checkpointing,
    read_bf16,
    read_checkpoint,
    read_fp16,
    read_monitor,
    read_wandb,
)
from runtime.config.zero import ZeroConfig, read_zero


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
    torch_autocast: TorchAutocastConfig = field(default_factory=TorchAutocastConfig)
    fp8: FP8Config = field(default_factory=FP8Config)  # ours: float8 linear layers through torchao
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
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)  # read for a PipelineModule only
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)  # the `compile` section (runtime.compile)
    memory_breakdown: bool = False
    dataloader_drop_last: bool = False
    disable_python_gc: bool = False  # cyclic GC off while the engine lives (runtime/engine/python_gc.py)
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
# the feature. ("pipeline" is read below for a PipelineModule and refused by this table for any other model.)
_UNSUPPORTED_TOP_LEVEL = {
    "amp": "apex AMP",
    "pipeline": "a pipeline section for a model that is not a PipelineModule (runtime.pipe.PipelineModule, "
    "deepspeed.pipe.PipelineModule: pipeline parallelism)",
    "sequence_parallel_size": "sequence parallelism without its groups (pass initialize(mpu=...) the Ulysses "
    "groups of register_with_transformers or runtime.sequence.init_sequence_parallel)",
    "compression_training": "compression training",
    "compression": "compression",
    "elasticity": "elastic training",
    "autotuning": "autotuning",
    "flops_profiler": "flops profiler",
    "comms_logger": "communication logger",
    "comet": "Comet monitor",
    "sparse_attention": "sparse attention",
    "data_efficiency": "data efficiency library",
    "curriculum_learning": "curriculum learning",
    "eigenvalue": "eigenvalue computation",
    "progressive_layer_drop": "progressive layer drop",
    "nebula": "Nebula checkpointing",
    "quantize_training": "quantization-aware training",
    "weight_quantization": "weight quantization",
    "hybrid_engine": "hybrid engine (RLHF)",
    "data_types": "data_types (gradient accumulation dtype)",
    "expert_parallel": "AutoEP expert parallelism",
}


def _never_if_inf(check: Any) -> Any:
    """Accelerate writes steps_per_print = float("inf") for "never"; that is 0 here."""

    def read(path: str, value: Any) -> Any:
        return 0 if isinstance(value, float) and value == float("inf") else check(path, value)

    return read


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

    source: a .json/.yaml/.yml path or a mapping. world_size: the data-parallel size, the ranks that split
    each batch (the caller must know it; it is never assumed to be 1): the world divided by the pipeline
    and model-parallel degrees, which the caller works out from the job's grid (a pipeline's topology, an
    mpu's data group, or the world over tensor_parallel.autotp_size). model: used to resolve "auto"
    values derived from the model (hidden-size-based ZeRO-3 bucket sizes, fp16/bf16 "enabled"); a
    PipelineModule also has its "pipeline" section read (any other model has it refused).
    auto_values: values for other "auto" keys by key path, e.g. {"optimizer.params.lr": 3e-4}, the way a
    trainer integration fills them.
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

    fp16 = read_fp16(top.section("fp16"), model)
    bf16 = read_bf16(top.section("bf16"), model)
    torch_autocast = read_torch_autocast(top.section("torch_autocast"))
    zero = read_zero(top.section("zero_optimization"), model)
    fp8 = read_fp8(top.section("fp8"))
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
        "disable_python_gc": top.get("disable_python_gc", Bool(), False),
    }
    sections = {
        "activation_checkpointing": read_activation_checkpointing(top.section("activation_checkpointing")),
        "tensorboard": read_monitor(top.section("tensorboard"), TensorBoardConfig),
        "csv_monitor": read_monitor(top.section("csv_monitor"), CSVMonitorConfig),
        "wandb": read_wandb(top.section("wandb")),
        "checkpoint": read_checkpoint(top.section("checkpoint")),
        "compile": read_compile(top.section("compile")),
    }
    tensor_parallel = read_tensor_parallel(top.section("tensor_parallel"))
    pipelined = is_pipeline_model(model)
    pipeline = read_pipeline(top.section("pipeline")) if pipelined else PipelineConfig()
    top.ignored("zero_force_ds_cpu_optimizer", True, "any torch optimizer runs on offloaded CPU shards")
    top.ignored("dump_state", False, "no state dump")
    # Lightning's DeepSpeedStrategy always writes an "aio" section. It tunes NVMe offload only, which is
    # refused by name where a section asks for it ("device": "nvme"), so without it aio changes nothing.
    top.ignored("aio", None, "async I/O tunes NVMe offload only, and nothing is offloaded to NVMe")
    top.default_only("sparse_gradients", False, "sparse gradients")
    # DeepSpeed 0.19's: gradients summed instead of averaged over ranks, and the client owning the step
    top.default_only(
        "gradient_allreduce_op", "mean", "gradients summed over the ranks (scale the loss by the world size)"
    )
    top.default_only(
        "managed_gradient_accumulation",
        True,
        "a step() that always updates (call engine.set_gradient_accumulation_boundary(True) before it)",
    )
    top.ignored("disable_allgather", False, "ZeRO gathers what each stage needs; nothing reads this key")
    top.ignored("vocabulary_size", None, "read by DeepSpeed's RL rollout code only")
    top.default_only("use_data_before_expert_parallelism", False, "expert-parallel (MoE) group ordering")
    for batch_key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        top.has(batch_key)  # read later by resolve_batch; declared now so finish() knows them
    dotted = [k for k in top.data if isinstance(k, str) and "." in k]
    for key in [k for k in dotted if k.split(".")[0] in _DOTTED_PREFIXES]:
        # TRL's prepare_deepspeed adds "zero_optimization.reduce_bucket_size" etc. at the top level
        top.ignored(key, object(), "a dotted top-level key is not a nested one; DeepSpeed ignores it too")
    unsupported = {k: v for k, v in _UNSUPPORTED_TOP_LEVEL.items() if not (pipelined and k == "pipeline")}
    top.finish(unsupported=unsupported)
    ctx.raise_pending()  # typos first: they often explain the errors that would follow

    train_batch_size, micro, gas = resolve_batch(top, world_size)
    ctx.raise_pending()

    if fp16.enabled and bf16.enabled:
        raise ConfigError("fp16.enabled", "fp16 and bf16 cannot both be enabled; keep one of them")
    if fp8.enabled and not bf16.enabled:
        # float8 matmuls take bf16 activations and give bf16 outputs; fp32 or fp16 working weights around
        # them would be cast at every layer, and fp16's loss scale would fight float8's own scales
        raise ConfigError(
            "fp8.enabled", "fp8 training runs on bf16 working weights", hint='set "bf16": {"enabled": true}'
        )
    _check_optimizer_with_zero(optimizer, zero, simple["zero_allow_untested_optimizer"])
    check_low_precision(bf16, fp16, torch_autocast, zero.stage, optimizer.type if optimizer else None)

    config = Config(
        train_batch_size=train_batch_size,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=gas,
        fp16=fp16,
        bf16=bf16,
        torch_autocast=torch_autocast,
        fp8=fp8,
        optimizer=optimizer,
        scheduler=scheduler,
        zero_optimization=zero,
        pipeline=pipeline,
        tensor_parallel=tensor_parallel,
        world_size=world_size,
        notes=tuple(ctx.notes),
        **simple,
        **sections,
    )
    given = {key for key in ("pipeline", "tensor_parallel") if top.data.get(key)}
    return _with_raw(config, given)


_DOTTED_PREFIXES = frozenset({"zero_optimization", "optimizer", "scheduler", "fp16", "bf16"})


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
        # internal fields (tuning that tests set, runtime/config/offload.py) are not config keys
        keys = [f.name for f in fields(value) if not f.metadata.get("internal")]
        return {name: _plain(getattr(value, name)) for name in keys}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _with_raw(config: Config, given: set[str]) -> Config:
    """`config.raw`: every key explicit, except the model-parallel sections the source did not have (a
    plain data-parallel config reads back as it was written)."""
    absent = {"pipeline", "tensor_parallel"} - given
    skip = {"raw", "notes", "world_size", *absent}
    raw = {k: v for k, v in _plain(config).items() if k not in skip}
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
