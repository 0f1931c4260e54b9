"""Tensor parallelism: AutoTP plans (`tp_model_init`) and the config's "tensor_parallel" section (read by
`runtime.config.parallel`, where `load_config` reads it too)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runtime.config.parallel import TensorParallelConfig, read_tensor_parallel_section
from runtime.tensor_parallel.autotp import (
    TensorParallelError,
    full_state_dict,
    local_numel,
    tp_model_init,
    tp_plan,
)


def read_tensor_parallel_config(section: Mapping[str, Any] | None) -> TensorParallelConfig:
    """DeepSpeed's "tensor_parallel" section: `autotp_size` (alias `tp_size`) is what we read; a typo gets
    "did you mean", a bad value its key path."""
    return read_tensor_parallel_section(section)


__all__ = [
    "TensorParallelConfig",
    "TensorParallelError",
    "full_state_dict",
    "local_numel",
    "read_tensor_parallel_config",
    "tp_model_init",
    "tp_plan",
]
