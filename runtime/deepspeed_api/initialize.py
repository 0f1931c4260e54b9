"""DeepSpeed's extra keywords of ``initialize``: ``config_params``, ``distributed_port``, ``mpu``.

Accelerate calls ``deepspeed.initialize(model=..., config_params=<dict>)``; older scripts pass
``distributed_port``, and Megatron-style scripts a model-parallel unit ``mpu``. `deepspeed_keywords` maps
the first two onto `runtime.initialize`'s own arguments, so that function keeps one meaning per argument;
`check_mpu_model` refuses what does not combine with an mpu (the engine's parallel plan,
runtime.parallel.plan, takes the mpu's groups).
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from runtime.parallel.mpu import MpuError
from runtime.pipe.module import PipelineModule

__all__ = ["check_mpu_model", "deepspeed_keywords"]


def deepspeed_keywords(config: Any, config_params: Any, distributed_port: int) -> Any:
    """The config to use, after checking DeepSpeed's keywords. ``config_params`` is DeepSpeed's older
    name of ``config`` (both at once is an error); ``distributed_port`` fills MASTER_PORT when no launcher
    set it."""
    if "MASTER_PORT" not in os.environ and distributed_port != 29500:
        os.environ["MASTER_PORT"] = str(distributed_port)
    if config_params is None:
        return config
    if config is not None:
        raise ValueError("initialize got both config= and config_params=; they are the same thing, pass one")
    return config_params


def check_mpu_model(model: nn.Module, mpu: Any) -> None:
    """Refuse what ``initialize(mpu=...)`` cannot train: a pipeline with an mpu (its topology is the
    pipeline's own mpu)."""
    if isinstance(model, PipelineModule):
        raise MpuError(
            "initialize got a PipelineModule and mpu=...: a pipeline takes its groups from its topology",
            hint="drop mpu, or build the PipelineModule with PipeModelDataParallelTopology(num_pp, num_mp, "
            "num_dp)",
        )
