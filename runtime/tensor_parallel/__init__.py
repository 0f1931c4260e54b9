"""Tensor parallelism: AutoTP plans (`tp_model_init`) and the config's "tensor_parallel" section."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.tensor_parallel.autotp import full_state_dict, local_numel, tp_model_init, tp_plan

_KEYS = {"autotp_size", "tp_size", "tp_overlap_comm", "partition_config", "tp_grain_size"}


@dataclass(frozen=True)
class TensorParallelConfig:
    autotp_size: int = 1  # ranks each sharded projection is split over (the grid's model dim)

    def __post_init__(self) -> None:
        if self.autotp_size < 1:
            raise ValueError(f"tensor_parallel.autotp_size must be at least 1, got {self.autotp_size}")


def read_tensor_parallel_config(section: Mapping[str, Any] | None) -> TensorParallelConfig:
    """DeepSpeed's "tensor_parallel" section; `autotp_size` (alias `tp_size`) is what we read."""
    section = dict(section or {})
    unknown = sorted(set(section) - _KEYS)
    if unknown:
        raise ValueError(f"tensor_parallel: unknown keys {unknown}; known keys are {sorted(_KEYS)}")
    size = section.get("autotp_size", section.get("tp_size", 1))
    return TensorParallelConfig(autotp_size=int(size))


__all__ = [
    "TensorParallelConfig",
    "full_state_dict",
    "local_numel",
    "read_tensor_parallel_config",
    "tp_model_init",
    "tp_plan",
]
