"""``deepspeed.checkpointing``: activation checkpointing (runtime.checkpointing)."""

from runtime.checkpointing import *  # noqa: F403
from runtime.checkpointing import checkpoint, configure, is_configured, reset  # noqa: F401
