"""The small top-level sections: `fp16`, `bf16`, `activation_checkpointing`, `checkpoint`, and the
monitors `tensorboard`, `csv_monitor` and `wandb`.

Owns their dataclasses, keys and DeepSpeed's defaults, and "enabled": "auto" for the two precision sections
(on when the model's floating-point weights already are in that dtype, the way HF Trainer fills it). That
fp16 and bf16 are not both on is checked by `runtime.config.load`, which sees both sections.

Monitors: job_name defaults to "DeepSpeedJobName", the wandb project to "deepspeed", and an empty
output_path means the current directory. Nothing here decides whether a backend can run: that an enabled
backend's package is installed is checked by `runtime.monitor.writers` at `runtime.initialize`, so loading
a config never imports tensorboard or wandb. DeepSpeed's other monitor, `comet`, is refused by name with
the other unsupported top-level keys in `runtime.config.load`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from runtime.config.checks import Bool, Choice, Float, Int, Str
from runtime.config.reader import AutoRefused, SectionReader


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
    # NaN). False also lets the offloaded step start during backward (runtime.offload.step.streamed).
    check_grad_overflow: bool = True
    # Stop with NonfiniteGradientsError after this many consecutive skipped steps; 0 = never stop (ours:
    # DeepSpeed has no such key).
    max_consecutive_nonfinite_steps: int = 10
    # DeepSpeed's 16-bit model states (ZeRO 1-3): the optimizer steps bf16 master weights (and gradients),
    # and with bf16_optimizer_states its moments are bf16 too (runtime.precision.master_adam).
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False
    # Ours: round the bf16 masters stochastically in the Adam update, so updates smaller than half a bf16
    # ulp still move the weights on average (round-to-nearest drops them). Read with bf16 masters only.
    stochastic_rounding: bool = True


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


def read_fp16(r: SectionReader, model: torch.nn.Module | None) -> FP16Config:
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


def read_bf16(r: SectionReader, model: torch.nn.Module | None) -> BF16Config:
    cfg = BF16Config(
        enabled=r.get("enabled", Bool(), False, auto=lambda: _enabled_from_model(model, torch.bfloat16)),
        check_grad_overflow=r.get("check_grad_overflow", Bool(), True),
        max_consecutive_nonfinite_steps=r.get("max_consecutive_nonfinite_steps", Int(0), 10),
    )
    r.ignored("immediate_grad_update", False, "gradients are reduced during backward, applied at the step")
    masters = r.get("bf16_master_weights_and_grads", Bool(), False)
    cfg = replace(
        cfg,
        bf16_master_weights_and_grads=masters,
        bf16_optimizer_states=r.get("bf16_optimizer_states", Bool(), False),
        stochastic_rounding=r.get("stochastic_rounding", Bool(), True),
    )
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


def read_activation_checkpointing(r: SectionReader) -> ActivationCheckpointingConfig:
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


def read_checkpoint(r: SectionReader) -> CheckpointConfig:
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
# Monitors


@dataclass(frozen=True)
class TensorBoardConfig:
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass(frozen=True)
class CSVMonitorConfig:
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass(frozen=True)
class WandbConfig:
    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


def read_monitor(r: SectionReader, cls: type[TensorBoardConfig] | type[CSVMonitorConfig]) -> Any:
    cfg = cls(
        enabled=r.get("enabled", Bool(), False),
        output_path=r.get("output_path", Str(), ""),
        job_name=r.get("job_name", Str(), "DeepSpeedJobName"),
    )
    r.finish()
    return cfg


def read_wandb(r: SectionReader) -> WandbConfig:
    cfg = WandbConfig(
        enabled=r.get("enabled", Bool(), False),
        group=r.get("group", Str(nullable=True), None),
        team=r.get("team", Str(nullable=True), None),
        project=r.get("project", Str(), "deepspeed"),
    )
    r.finish()
    return cfg
