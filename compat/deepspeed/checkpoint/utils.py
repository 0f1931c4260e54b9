"""``deepspeed.checkpoint.utils``: ``clone_tensors_for_torch_save`` (runtime.ds_utils)."""

from runtime.ds_utils import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]
