"""``deepspeed.checkpointing``: activation checkpointing and the model-parallel random streams
(runtime.checkpointing, runtime.parallel.rng); every name is runtime.checkpointing's ``__all__``."""

from runtime.checkpointing import *  # noqa: F403
