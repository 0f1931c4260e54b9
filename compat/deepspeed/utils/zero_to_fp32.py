"""``deepspeed.utils.zero_to_fp32``: one fp32 state dict from a sharded checkpoint
(runtime.checkpoint.consolidate; the ``ds_consolidate`` command)."""

from runtime.checkpoint.consolidate import main
from runtime.ds_utils import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "main",
]

if __name__ == "__main__":
    main()
