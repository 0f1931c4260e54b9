"""``deepspeed.runtime.activation_checkpointing.checkpointing``: the same module as
``deepspeed.checkpointing``."""

from deepspeed.checkpointing import *  # noqa: F403
from deepspeed.checkpointing import (  # noqa: F401
    CudaRNGStatesTracker,
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    reset,
)
