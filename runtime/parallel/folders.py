"""Where model-parallel engines keep their checkpoints, as a data-parallel engine sees it.

A pipeline stage, a tensor-parallel rank or an mpu's model rank each keep their own ZeRO checkpoint in a
folder of the checkpoint root whose name carries the degree (`pipe_stage_SS_of_NN`, `tp_rank_RR_of_NN`,
`mp_rank_RR_of_NN`; the engines' `checkpoint_folder`), so the root itself has no `latest`. A plain
engine given such a root would only say that there is no `latest` file; `data_parallel_root` names the
degree the checkpoint was saved with instead, as the model-parallel engines do for a degree mismatch.
A path one level inside a checkpoint directory (one tag's folder, holding a manifest; or one
model-parallel rank's folder) is refused naming the directory (and the tag) to give instead
(`runtime.checkpoint.misplaced`, for every engine's load and ds_consolidate); a file named like a
model-parallel folder (DeepSpeed's `mp_rank_00_model_states.pt` in a tag folder) is not one. `part_root`
is where an engine keeps its part of a checkpoint under the directory it was given.
"""

from __future__ import annotations

import os

from runtime.checkpoint.manifest import CheckpointNotFound
from runtime.checkpoint.misplaced import FAMILIES as _FAMILIES
from runtime.checkpoint.misplaced import FOLDER as _FOLDER
from runtime.checkpoint.misplaced import misplaced_root


def data_parallel_root(root: str | os.PathLike) -> str:
    """`root`, for a data-parallel engine to load from; a root holding only model-parallel folders (no
    `latest` of its own) is refused, naming the degree it was saved with, and so is one tag's folder."""
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
            match = _FOLDER.fullmatch(saved[0][len(prefix) :])
            assert match is not None  # `saved` holds only names it matched
            degree = str(int(match.group(2)))
            more = ", ..." if len(saved) > 4 else ""
            raise CheckpointNotFound(
                f"{path} holds a checkpoint saved with {saved_with.format(degree)} "
                f"({', '.join(saved[:4])}{more}), but this engine has no {lacks}",
                hint=f"resume with {resume.format(degree)}, as it was saved",
            )
    return path


def part_root(root: str | os.PathLike, folder: tuple[str, str, str] | None, *, loading: bool) -> str:
    """Where an engine whose `checkpoint_folder()` is `folder` keeps its checkpoint under `root`. Loading,
    a misplaced root (a tag's or a rank's folder) is refused naming the directory to give, and a root
    without this rank's folder names the folders it holds."""
    if folder is None:
        return data_parallel_root(root) if loading else os.fspath(root)
    name, prefix, what = folder
    path = os.path.join(os.fspath(root), name)
    if loading and not os.path.isdir(path):
        misplaced = misplaced_root(root)
        if misplaced is not None:
            raise misplaced
        saved = sorted(n for n in os.listdir(root) if n.startswith(prefix)) if os.path.isdir(root) else []
        raise CheckpointNotFound(
            f"{os.fspath(root)} has no checkpoint for {what} ({name}); it holds {saved or 'none'}",
            hint="resume with the pipeline and tensor-parallel degrees the checkpoint was saved with",
        )
    return path


__all__ = ["data_parallel_root", "misplaced_root", "part_root"]
