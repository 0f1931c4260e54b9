"""``deepspeed.utils.zero_to_fp32``: one fp32 state dict from a checkpoint folder, ours or DeepSpeed's
(runtime.checkpoint.fp32_state, runtime.checkpoint.portable_cli); ``python -m deepspeed.utils.zero_to_fp32
CHECKPOINT_DIR OUTPUT_DIR`` takes DeepSpeed's arguments and exits 1 on every error."""

import sys

from runtime.checkpoint.fp32_state import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    get_model_state_file,
    get_optim_files,
    load_state_dict_from_zero_checkpoint,
)


def main(argv=None) -> int:
    from runtime.checkpoint.fp32_state import fp32_state_dict
    from runtime.checkpoint.portable_cli import main as command

    return command(
        argv,
        prog="zero_to_fp32",
        reader=lambda d, t, x: fp32_state_dict(d, t, exclude_frozen_parameters=x),
    )


__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_file",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
    "main",
]

if __name__ == "__main__":
    sys.exit(main())
