"""Tensor parallelism: AutoTP plans (`tp_model_init`, `tp_plan`) and the gathered Hugging Face state dict.
The config's "tensor_parallel" section is `runtime.config.parallel`'s."""

from __future__ import annotations

from runtime.tensor_parallel.autotp import (
    TensorParallelError,
    full_state_dict,
    local_numel,
    tp_model_init,
    tp_plan,
)

__all__ = [
    "TensorParallelError",
    "full_state_dict",
    "local_numel",
    "tp_model_init",
    "tp_plan",
]
