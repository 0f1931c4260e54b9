"""``deepspeed.runtime.activation_checkpointing``: where DeepSpeed keeps ``deepspeed.checkpointing``."""

from deepspeed.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
