"""``deepspeed.runtime.activation_checkpointing.checkpointing``: the same module as
``deepspeed.checkpointing``."""

from deepspeed.checkpointing import *  # noqa: F403
