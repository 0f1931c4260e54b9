"""A pipeline checkpoint as one plain state dict, and a stage's share of a plain state dict.

`PipelineEngine.save_checkpoint` writes one ZeRO checkpoint per stage (`pipe_stage_SS_of_NN/`, with
`_chunks_VV` when a stage holds several chunks: all of them are in the one checkpoint). Since
parameter names carry global layer indices, the stages' consolidated state dicts (the existing
`get_fp32_state_dict_from_checkpoint`, no process group needed) simply add up; a tied weight appears on
several stages and must be equal there. `load_stage_state_dict` gives a `PipelineModule` built at any
pipeline degree (and chunks per stage) the entries its stage holds, so a run continues at another degree,
chunking or world size (weights only; optimizer state restarts).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from runtime.checkpoint.consolidate import get_fp32_state_dict_from_checkpoint
from runtime.pipe.config import PipelineError
from runtime.pipe.module import PipelineModule

_WHOLE = "give the root that PipelineEngine.save_checkpoint wrote, with every stage's folder"

_STAGE_DIR = re.compile(r"^pipe_stage_(\d+)_of_(\d+)(?:_chunks_(\d+))?$")


def pipeline_stage_dirs(checkpoint_dir: str | os.PathLike[str]) -> list[Path]:
    """The stage directories of a pipeline checkpoint, by stage; every stage must be present."""
    root = Path(checkpoint_dir)
    found = {}
    degrees = set()
    for child in root.iterdir() if root.is_dir() else []:
        match = _STAGE_DIR.match(child.name)
        if match:
            found[int(match.group(1))] = child
            degrees.add((int(match.group(2)), int(match.group(3) or 1)))  # (stages, chunks per stage)
    if not found:
        raise PipelineError(f"{root} holds no pipeline stage directories (pipe_stage_SS_of_NN)", hint=_WHOLE)
    if len(degrees) > 1:
        raise PipelineError(
            f"{root} mixes checkpoints of pipelines with {sorted(degrees)} (stages, chunks per stage)",
            hint="keep one pipeline's checkpoints per root (save_checkpoint's save_dir)",
        )
    stages = degrees.pop()[0]
    missing = sorted(set(range(stages)) - set(found))
    if missing:
        raise PipelineError(
            f"{root}: the checkpoint of a {stages}-stage pipeline lacks stages {missing}", hint=_WHOLE
        )
    return [found[s] for s in range(stages)]


def get_fp32_state_dict_from_pipeline_checkpoint(
    checkpoint_dir: str | os.PathLike[str], tag: str | None = None, *, verify: bool = True
) -> dict[str, torch.Tensor]:
    """The whole model's state dict (fp32 master weights) from every stage of a pipeline checkpoint."""
    merged: dict[str, torch.Tensor] = {}
    for stage_dir in pipeline_stage_dirs(checkpoint_dir):
        for key, value in get_fp32_state_dict_from_checkpoint(stage_dir, tag, verify=verify).items():
            if key in merged and not torch.equal(merged[key], value):
                raise PipelineError(
                    f"{key} differs between the stages holding it (a tied weight out of step?)",
                    hint="save from one run: every stage's folder of the same step",
                )
            merged[key] = value
    return merged


def load_stage_state_dict(module: PipelineModule, state_dict: dict[str, torch.Tensor]) -> None:
    """Load the entries of `state_dict` this stage holds into `module` (before building the engine)."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state_dict))
    if missing:
        raise PipelineError(
            f"stage {module.stage_id}: the state dict lacks {missing}",
            hint="build the PipelineModule with the same layers as the model the state dict was saved from",
        )
    module.load_state_dict({key: state_dict[key] for key in own})


__all__ = [
    "get_fp32_state_dict_from_pipeline_checkpoint",
    "load_stage_state_dict",
    "pipeline_stage_dirs",
]
