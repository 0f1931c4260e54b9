"""DeepSpeed's extra keywords of ``initialize``: ``config_params``, ``distributed_port``, ``mpu``.

Accelerate calls ``deepspeed.initialize(model=..., config_params=<dict>)``; older scripts pass
``distributed_port`` or a model-parallel unit ``mpu``. `deepspeed_keywords` maps them onto
`runtime.initialize`'s own arguments, so that function keeps one meaning per argument.
"""

from __future__ import annotations

import os
from typing import Any

from runtime.unsupported import unsupported

__all__ = ["deepspeed_keywords"]


def deepspeed_keywords(config: Any, config_params: Any, distributed_port: int, mpu: Any) -> Any:
    """The config to use, after checking DeepSpeed's keywords. ``config_params`` is DeepSpeed's older
    name of ``config`` (both at once is an error); ``distributed_port`` fills MASTER_PORT when no launcher
    set it; ``mpu`` (model parallelism) is refused."""
    if mpu is not None:
        unsupported(
            "model parallelism through initialize(mpu=...)",
            "dslaunch trains with data parallelism and ZeRO; drop mpu (ZeRO stage 3 splits large models)",
        )
    if "MASTER_PORT" not in os.environ and distributed_port != 29500:
        os.environ["MASTER_PORT"] = str(distributed_port)
    if config_params is None:
        return config
    if config is not None:
        raise ValueError("initialize got both config= and config_params=; they are the same thing, pass one")
    return config_params
