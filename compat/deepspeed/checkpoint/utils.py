"""``deepspeed.checkpoint.utils``: ``clone_tensors_for_torch_save`` (runtime.deepspeed_api.utils)."""

from runtime.deepspeed_api.utils import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]
