"""DeepSpeed's ``DeepSpeedConfig`` object: the checked config with DeepSpeed's attribute names.

Scripts and integrations build ``DeepSpeedConfig(path_or_dict)`` to ask "which ZeRO stage, which dtype,
what batch size" before (or without) an engine. This reads the config through `runtime.config.load_config`
(so every check and every "did you mean" applies) with the job's world size, and answers by DeepSpeed's
attribute names from the typed `Config`; ``_param_dict`` is the source mapping, as in DeepSpeed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from runtime.config import Config, load_config, read_config_file, render_config
from runtime.deepspeed_api.unsupported import unsupported
from runtime.parallel.mpu import resolve_mpu

__all__ = ["DeepSpeedConfig"]


class DeepSpeedConfig:
    """A checked DeepSpeed config. ``config``: a .json/.yaml path or a mapping. The world size (what the
    batch arithmetic counts) is the data-parallel size of ``mpu`` when one is given (runtime.parallel.mpu),
    else the process group's, or WORLD_SIZE, or 1."""

    def __init__(
        self, config: str | os.PathLike | Mapping[str, Any], mpu: Any = None, mesh_device: Any = None
    ):
        if mesh_device is not None:
            unsupported("DeepSpeedConfig(mesh_device=...)", "pass mpu=, or use initialize(mpu=...)")
        source = read_config_file(config) if isinstance(config, (str, os.PathLike)) else dict(config)
        self._param_dict = source
        if mpu is not None:
            self.world_size = resolve_mpu(mpu).data_size
        else:
            self.world_size = _world_size()
        self.config: Config = load_config(source, world_size=self.world_size)

    def __repr__(self) -> str:
        return f"DeepSpeedConfig(world_size={self.world_size}, zero_stage={self.zero_optimization_stage})"

    def print(self, name: str) -> None:
        print(f"{name}:\n{render_config(self.config)}", flush=True)

    # batch arithmetic
    @property
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    @property
    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    # precision
    @property
    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    @property
    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    @property
    def fp16_auto_cast(self) -> bool:
        return self.config.fp16.auto_cast

    @property
    def loss_scale(self) -> float:
        return self.config.fp16.loss_scale

    @property
    def initial_dynamic_scale(self) -> float:
        return float(2**self.config.fp16.initial_scale_power)

    @property
    def dtype(self) -> torch.dtype:
        return self.config.param_dtype

    # ZeRO
    @property
    def zero_config(self) -> Any:
        return self.config.zero_optimization

    @property
    def zero_enabled(self) -> bool:
        return self.config.zero_optimization.stage > 0

    @property
    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    # everything else a script tends to read
    @property
    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    @property
    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    @property
    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    @property
    def optimizer_name(self) -> str | None:
        return None if self.config.optimizer is None else self.config.optimizer.type.lower()

    @property
    def optimizer_params(self) -> dict[str, Any] | None:
        return None if self.config.optimizer is None else dict(self.config.optimizer.params)

    @property
    def scheduler_name(self) -> str | None:
        return None if self.config.scheduler is None else self.config.scheduler.type

    @property
    def scheduler_params(self) -> dict[str, Any] | None:
        return None if self.config.scheduler is None else dict(self.config.scheduler.params)


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))
