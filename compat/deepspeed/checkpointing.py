"""``deepspeed.checkpointing``: activation checkpointing and the model-parallel random streams
(runtime.activation_checkpointing, runtime.parallel.rng); every name is that module's ``__all__``."""

from runtime.activation_checkpointing import *  # noqa: F403
