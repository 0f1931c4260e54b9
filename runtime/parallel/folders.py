"""Where model-parallel engines keep their checkpoints, as a data-parallel engine sees it.

A pipeline stage, a tensor-parallel rank or an mpu's model rank each keep their own ZeRO checkpoint in a
folder of the checkpoint root whose name carries the degree (`pipe_stage_SS_of_NN`, `tp_rank_RR_of_NN`,
`mp_rank_RR_of_NN`; the engines' `checkpoint_folder`), so the root itself has no `latest`. A plain
engine given such a root would only say that there is no `latest` file; `data_parallel_root` names the
degree the checkpoint was saved with instead, as the model-parallel engines do for a degree mismatch.
A path one level inside a checkpoint directory (one tag's folder, holding a manifest; or one
model-parallel rank's folder) is refused naming the directory (and the tag) to give instead
(`misplaced_root`, for every engine's load); a file named like a model-parallel folder (DeepSpeed's
`mp_rank_00_model_states.pt` in a tag folder) is not one.
"""

from __future__ import annotations

import os
import re

# folder prefix -> (what it was saved with, what this engine lacks, how to resume); {} is the degree
_FAMILIES = (
    (
        "tp_rank_",
        "tensor-parallel degree {}",
        "tensor parallelism",
        '"tensor_parallel": {{"autotp_size": {}}}',
    ),
    ("pipe_stage_", "{} pipeline stages", "pipeline", "a PipelineModule of num_stages={}"),
    ("mp_rank_", "model-parallel size {}", "model parallelism", "initialize(mpu=...) of model size {}"),
)


_FOLDER = re.compile(r"(\d+)_of_(\d+)")  # after the prefix: this rank's index and the degree


def misplaced_root(root: str | os.PathLike) -> Exception | None:
    """The error for a path one level inside a checkpoint directory, where the directory was meant: one
    tag's folder (it holds a manifest), or one model-parallel rank's folder (`pipe_stage_00_of_02`); None
    for anything else. Every engine's load can ask this before looking for its own folders."""
    from runtime.checkpoint import CheckpointNotFound
    from runtime.checkpoint.manifest import MANIFEST

    path = os.fspath(root)
    if not os.path.isdir(path):
        return None
    parent, name = os.path.split(os.path.normpath(path))
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return CheckpointNotFound(
            f"{path} is the folder of one checkpoint (tag {name!r}), not a checkpoint directory: "
            "load_checkpoint takes the directory save_checkpoint was given",
            hint=f"load_checkpoint({parent!r}, tag={name!r}), or load_checkpoint({parent!r}) for its "
            "latest tag",
        )
    for prefix, saved_with, _lacks, _resume in _FAMILIES:
        match = _FOLDER.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
        if match is not None:
            return CheckpointNotFound(
                f"{path} is one rank's part of a checkpoint saved with "
                f"{saved_with.format(int(match.group(2)))}, not a checkpoint directory: load_checkpoint "
                "takes the directory save_checkpoint was given",
                hint=f"load_checkpoint({parent!r})",
            )
    return None


def data_parallel_root(root: str | os.PathLike) -> str:
    """`root`, for a data-parallel engine to load from; a root holding only model-parallel folders (no
    `latest` of its own) is refused, naming the degree it was saved with, and so is one tag's folder."""
    from runtime.checkpoint import CheckpointNotFound

    path = os.fspath(root)
    misplaced = misplaced_root(path)
    if misplaced is not None:
        raise misplaced
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "latest")):
        return path
    for prefix, saved_with, lacks, resume in _FAMILIES:
        saved = sorted(
            name
            for name in os.listdir(path)
            if name.startswith(prefix)
            and _FOLDER.fullmatch(name[len(prefix) :])
            and os.path.isdir(os.path.join(path, name))
        )
        if saved:
            degree = str(int(_FOLDER.fullmatch(saved[0][len(prefix) :]).group(2)))
            more = ", ..." if len(saved) > 4 else ""
            raise CheckpointNotFound(
                f"{path} holds a checkpoint saved with {saved_with.format(degree)} "
                f"({', '.join(saved[:4])}{more}), but this engine has no {lacks}",
                hint=f"resume with {resume.format(degree)}, as it was saved",
            )
    return path


__all__ = ["data_parallel_root", "misplaced_root"]
