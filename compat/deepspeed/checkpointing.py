"""``deepspeed.checkpointing``: activation checkpointing and the model-parallel random streams
(runtime.checkpointing, runtime.parallel.rng)."""

from runtime.checkpointing import *  # noqa: F403
from runtime.checkpointing import (  # noqa: F401
    CudaRNGStatesTracker,
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    reset,
)
