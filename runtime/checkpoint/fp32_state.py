"""One fp32 state dict from any checkpoint folder: the entry behind DeepSpeed's `zero_to_fp32` names.

Ours or DeepSpeed's (runtime.checkpoint.consolidate), or a pipeline checkpoint's root
(`pipe_stage_SS_of_NN/`, merged by runtime.pipe.checkpoint); a tensor-parallel root (`tp_rank_RR_of_NN/`)
is refused with its degree named. It sits above consolidate and runtime.pipe, which imports consolidate.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from runtime.checkpoint.consolidate import deepspeed_state_dict, get_fp32_state_dict_from_checkpoint
from runtime.checkpoint.manifest import CheckpointError
from runtime.checkpoint.portable import model_parallel_root
from runtime.pipe.checkpoint import get_fp32_state_dict_from_pipeline_checkpoint


def fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str], tag: str | None = None, *, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor]:
    """The fp32 state dict of any checkpoint folder: ours or DeepSpeed's, or a pipeline root (stages merged).
    Frozen parameters are left out only where the checkpoint marks them (DeepSpeed's)."""
    root = Path(checkpoint_dir)
    parallel = model_parallel_root(root)
    if parallel is not None:
        what, degree = parallel
        raise CheckpointError(
            f"{root} is a {what} checkpoint ({what} degree {degree}, one sub-folder per rank): its "
            "shards are not merged into one state dict",
            hint="load it with the same tensor-parallel degree and save the full weights with "
            "engine.save_16bit_model, or consolidate one rank's sub-folder",
        )
    if root.is_dir() and any(p.name.startswith("pipe_stage_") for p in root.iterdir()):
        try:
            return get_fp32_state_dict_from_pipeline_checkpoint(root, tag)
        except ValueError as error:  # stage folders missing, mixed or disagreeing
            raise CheckpointError(str(error)) from None
    deepspeed = deepspeed_state_dict(root, tag, exclude_frozen_parameters=exclude_frozen_parameters)
    return deepspeed if deepspeed is not None else get_fp32_state_dict_from_checkpoint(root, tag)
