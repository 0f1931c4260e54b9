"""One fp32 state dict from any checkpoint folder: the entry behind DeepSpeed's `zero_to_fp32` names.

Ours or DeepSpeed's (runtime.checkpoint.consolidate), or a pipeline checkpoint's root
(`pipe_stage_SS_of_NN/`, merged by pipeline_root); a tensor-parallel root (`tp_rank_RR_of_NN/`)
is refused with its degree named. DeepSpeed's three functions (`get_fp32_state_dict_from_zero_checkpoint`,
`convert_zero_checkpoint_to_fp32_state_dict`, `load_state_dict_from_zero_checkpoint`) are here, for
compat's `deepspeed.utils.zero_to_fp32` to name, with the two file finders Lightning's converter calls
(`get_optim_files`, `get_model_state_file`): in our folders they find the per-rank `*_optim_states.pt`
descriptors (stage and partition count, no tensors) and the model-states file (client keys at its top).
It sits above consolidate and runtime.pipe (which imports consolidate), so nothing in runtime.pipe or
runtime.deepspeed_api.utils may import it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from runtime.checkpoint.consolidate import deepspeed_state_dict, get_fp32_state_dict_from_checkpoint
from runtime.checkpoint.manifest import CheckpointError
from runtime.checkpoint.pipeline_root import get_fp32_state_dict_from_pipeline_checkpoint
from runtime.checkpoint.portable_cli import write_state_dict
from runtime.checkpoint.portable_folders import model_parallel_root


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


# -- DeepSpeed's zero_to_fp32 functions ---------------------------------------------------------------------
def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str, tag: str | None = None, exclude_frozen_parameters: bool = False, **_: Any
) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of a checkpoint directory (the tag `latest` names unless `tag`): ours,
    DeepSpeed's, or a pipeline root. DeepSpeed's `lazy_mode` is accepted; tensors are always real."""
    return fp32_state_dict(checkpoint_dir, tag, exclude_frozen_parameters=exclude_frozen_parameters)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str,
    output_dir: str,
    max_shard_size: str | int | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> list[str]:
    """Write the fp32 weights as DeepSpeed does: `output_dir`/pytorch_model.bin (model.safetensors with
    safe_serialization), split with an index JSON above max_shard_size; an `output_dir` ending in .bin, .pt,
    .pth or .safetensors is one file. Returns the files written."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    files = write_state_dict(
        state, output_dir, safe_serialization=safe_serialization, max_shard_size=max_shard_size
    )
    return [str(f) for f in files]


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str, tag: str | None = None
) -> torch.nn.Module:
    """Load the consolidated fp32 weights into `model` (on the CPU) and return it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def _natural_key(path: Path) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def get_optim_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Every rank's `*_optim_states.pt` in a tag folder, in rank order (rank 10 after rank 9). In our
    folders each holds ["optimizer_state_dict"]["zero_stage"] and "partition_count"; the state itself
    is in the rank's .safetensors shard."""
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a checkpoint tag folder")
    files = sorted(folder.glob("*_optim_states.pt"), key=_natural_key)
    if not files:
        raise FileNotFoundError(f"{folder} has no *_optim_states.pt files")
    return [str(f) for f in files]


def get_model_state_file(checkpoint_dir: str | os.PathLike[str], zero_stage: int) -> str:
    """The tag folder's model-states file (DeepSpeed's name at ZeRO stage 3 is rank 0's
    `zero_pp_rank_0_mp_rank_00_model_states.pt`; ours is `mp_rank_00_model_states.pt` at every stage)."""
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a checkpoint tag folder")
    names = ["mp_rank_00_model_states.pt"]
    if zero_stage >= 3:
        names.insert(0, "zero_pp_rank_0_mp_rank_00_model_states.pt")
    for name in names:
        if (folder / name).is_file():
            return str(folder / name)
    raise FileNotFoundError(f"{folder / names[0]} does not exist")
