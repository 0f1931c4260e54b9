"""Refusals of option combinations: the checks that look at two sections at once, or at one section and
the shape of the job (pipeline stages, tensor-parallel ranks, a Megatron mpu).

Every refusal is a `ConfigError` (a `UserError`: one line, a hint, exit code 2) whose message starts with
the key path to change. The checks are pure functions: where one needs a fact that only the running job
knows (the mpu's group sizes, the stages a `PipelineModule` was built with, the world size), the caller
passes it in, so the rules stay here, in one place, and are testable without processes.

The engines call them while they are built (`runtime.engine` calls `check_offload_param` for every
engine, and `check_data_parallel_engine` for the plain one).
"""

from __future__ import annotations

from typing import Any

from runtime.config.pipeline import PipelineConfig, check_schedule
from runtime.config.reader import ConfigError
from runtime.config.zero import ZeroConfig

# ZeRO stage 3 would partition the parametrized tensor-parallel shards again; not built or tested
TENSOR_PARALLEL_MAX_ZERO_STAGE = 2


def check_offload_param(zero: ZeroConfig) -> None:
    """Parameter offload needs optimizer offload: the host optimizer step writes the updated weights into
    the offloaded shards."""
    if zero.offload_param.enabled and zero.offload_optimizer.device != "cpu":
        raise ConfigError(
            "zero_optimization.offload_param.device",
            f"{zero.offload_param.device!r} needs zero_optimization.offload_optimizer = "
            '{"device": "cpu"} too (the host optimizer step writes the updated weights into the '
            "offloaded shards); parameter offload alone serves engines without an optimizer (inference)",
            hint='add "offload_optimizer": {"device": "cpu"} to zero_optimization, or remove offload_param',
        )


def check_data_parallel_engine(config: Any) -> None:
    """An engine without a parallel plan trains data parallelism alone: a tensor-parallel degree needs the
    plan that shards the model first."""
    if config.tensor_parallel.autotp_size > 1:
        raise ConfigError(
            "tensor_parallel.autotp_size",
            f"{config.tensor_parallel.autotp_size} needs the model sharded over a tensor-parallel grid, "
            "which runtime.initialize does for such a config (runtime.parallel.plan.build_parallel_plan), "
            "not this engine alone",
        )


def check_tensor_parallel_world(autotp_size: int, world: int) -> None:
    """The tensor-parallel degree must divide the ranks of the job: each data-parallel replica spans it."""
    if world % autotp_size:
        raise ConfigError(
            "tensor_parallel.autotp_size",
            f"{autotp_size} does not divide the world size {world}: each data-parallel replica needs "
            f"{autotp_size} ranks",
            hint=f"launch a multiple of {autotp_size} ranks, or choose an autotp_size that divides {world}",
        )


def check_batch_over_data(raw: Any, data_size: int, describe: str) -> None:
    """An explicit train_batch_size must split over the data-parallel ranks (model-parallel ranks share
    their samples); said before the batch arithmetic, whose message would count only data ranks."""
    batch = raw.get("train_batch_size") if isinstance(raw, dict) else None
    if isinstance(batch, int) and not isinstance(batch, bool) and batch % data_size:
        raise ConfigError(
            "train_batch_size",
            f"{batch} is not divisible by the data-parallel size {data_size} ({describe})",
            hint="train_batch_size counts the samples of all data-parallel ranks together: make it a "
            "multiple of the data-parallel size (model-parallel ranks share their samples)",
        )


def check_config_world(world_size: int, data_size: int, describe: str) -> None:
    """A config loaded beforehand (a `Config`) must have been resolved for this job's data-parallel size."""
    if world_size != data_size:
        raise ConfigError(
            "train_batch_size",
            f"the config was resolved for {world_size} data-parallel ranks, but the job has {data_size} "
            f"({describe})",
            hint="load it with load_config(..., world_size=<the data-parallel size>), or pass the dict",
        )


def check_tensor_parallel(config: Any, describe: str) -> None:
    """AutoTP runs with ZeRO stages 0-2 over the data ranks."""
    stage = config.zero_optimization.stage
    if stage > TENSOR_PARALLEL_MAX_ZERO_STAGE:
        raise ConfigError(
            "zero_optimization.stage",
            f"{stage} with tensor parallelism (AutoTP) ({describe}) is not supported; use stage 0, 1 or 2",
            hint="stage 2 shards gradients and optimizer state over the data-parallel ranks",
        )


def check_mpu(config: Any) -> None:
    """A Megatron mpu brings a model that is already split: AutoTP on top of it is refused."""
    if config.tensor_parallel.autotp_size > 1:
        raise ConfigError(
            "tensor_parallel.autotp_size",
            "initialize got both mpu=... and tensor_parallel.autotp_size > 1: the mpu's model already is "
            "tensor parallel; pass one of them",
            hint="remove the tensor_parallel section, or drop mpu= and let AutoTP split a whole model",
        )


def check_pipeline(config: Any, *, stages: int, chunks_per_stage: int, model_dim: int) -> str:
    """Refuse what a pipeline cannot do, before any training; returns the schedule to run. `stages`,
    `chunks_per_stage` and `model_dim` (the topology's model axis): what the PipelineModule was built with."""
    zero = config.zero_optimization
    if zero.stage >= 2:
        raise ConfigError(
            "zero_optimization.stage",
            f"{zero.stage} cannot be combined with pipeline parallelism ({stages} stages): "
            "gradients accumulate over micro-batches in every stage, so sharding them (stage 2) or the "
            "parameters (stage 3) does not fit, as in DeepSpeed",
            hint="use ZeRO stage 0 or 1 with a PipelineModule",
        )
    if zero.offload_optimizer.device != "none":
        raise ConfigError(
            "zero_optimization.offload_optimizer.device",
            f"{zero.offload_optimizer.device!r}: optimizer offload is not supported with pipeline "
            "parallelism yet",
            hint='remove offload_optimizer (or set "device": "none") when training a PipelineModule',
        )
    if zero.offload_param.device != "none":
        raise ConfigError(
            "zero_optimization.offload_param.device",
            f"{zero.offload_param.device!r}: parameter offload is ZeRO-3's, which pipelines do not take",
            hint='remove offload_param (or set "device": "none") when training a PipelineModule',
        )
    pipe: PipelineConfig = config.pipeline
    if pipe.stages is not None and pipe.stages != stages:
        raise ConfigError(
            "pipeline.stages",
            f"{pipe.stages} but the PipelineModule was built with {stages} stages",
            hint=f'set "stages": {stages} (or "auto"), or build the module with num_stages={pipe.stages}',
        )
    asked = config.tensor_parallel.autotp_size
    if config.tensor_parallel.explicit and asked != model_dim:
        raise ConfigError(
            "tensor_parallel.autotp_size",
            f"{asked} but the PipelineModule's topology has a model dimension of {model_dim}",
            hint=f"build the module with PipeModelDataParallelTopology(num_pp, num_mp={asked}, num_dp), or "
            f"set autotp_size to {model_dim}",
        )
    return check_schedule(pipe, stages, chunks_per_stage, config.gradient_accumulation_steps)


__all__ = [
    "TENSOR_PARALLEL_MAX_ZERO_STAGE",
    "check_batch_over_data",
    "check_config_world",
    "check_data_parallel_engine",
    "check_mpu",
    "check_offload_param",
    "check_pipeline",
    "check_tensor_parallel",
    "check_tensor_parallel_world",
]
