"""A pipeline checkpoint's root as one plain state dict: its stage folders found, their consolidations merged.

`PipelineEngine.save_checkpoint` writes one ZeRO checkpoint per stage (`pipe_stage_SS_of_NN/`, with
`_chunks_VV` when a stage holds several chunks: all of them are in the one checkpoint). Since parameter
names carry global layer indices, the stages' consolidated state dicts (`consolidate`, which merges them,
no process group needed) simply add up; a tied weight appears on several stages and must be equal there.

It lives with the checkpoint's readers, not in `runtime.pipe`, because it reads folders only: the
`zero_to_fp32` entry (`fp32_state`) reaches it without importing the pipeline engine, which itself saves
through this package (so `checkpoint` never imports `pipe`). `runtime.pipe.checkpoint` keeps the names.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from runtime.checkpoint.consolidate import get_fp32_state_dict_from_checkpoint
from runtime.checkpoint.manifest import CheckpointError

__all__ = [
    "PipelineCheckpointError",
    "get_fp32_state_dict_from_pipeline_checkpoint",
    "pipeline_stage_dirs",
]

_WHOLE = "give the root that PipelineEngine.save_checkpoint wrote, with every stage's folder"

_STAGE_DIR = re.compile(r"^pipe_stage_(\d+)_of_(\d+)(?:_chunks_(\d+))?$")


class PipelineCheckpointError(CheckpointError, ValueError):
    """A pipeline checkpoint's root that cannot be merged: stage folders missing, mixed or disagreeing (a
    ValueError as the pipeline's errors were, so older handlers still catch it)."""

    hint = _WHOLE


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
        raise PipelineCheckpointError(f"{root} holds no pipeline stage directories (pipe_stage_SS_of_NN)")
    if len(degrees) > 1:
        raise PipelineCheckpointError(
            f"{root} mixes checkpoints of pipelines with {sorted(degrees)} (stages, chunks per stage)",
            hint="keep one pipeline's checkpoints per root (save_checkpoint's save_dir)",
        )
    stages = degrees.pop()[0]
    missing = sorted(set(range(stages)) - set(found))
    if missing:
        raise PipelineCheckpointError(
            f"{root}: the checkpoint of a {stages}-stage pipeline lacks stages {missing}"
        )
    return [found[s] for s in range(stages)]


def get_fp32_state_dict_from_pipeline_checkpoint(
    checkpoint_dir: str | os.PathLike[str], tag: str | None = None, *, verify: bool = True
) -> dict[str, torch.Tensor]:
    """The whole model's state dict (fp32 master weights) from every stage of a pipeline checkpoint: its
    stage folders checked here, merged by the consolidation reader (which takes a pipeline root too)."""
    pipeline_stage_dirs(checkpoint_dir)
    return get_fp32_state_dict_from_checkpoint(checkpoint_dir, tag, verify=verify)
