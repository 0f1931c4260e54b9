"""A path one level inside a checkpoint directory, given where the directory was meant.

`engine.load_checkpoint` takes the directory save_checkpoint was given. Given one tag's folder (it holds a
manifest) or one model-parallel rank's folder (`pipe_stage_00_of_02`, `tp_rank_01_of_02`,
`mp_rank_00_of_02`) it would only say that it has no `latest` file, and suggest a tag; `misplaced_root`
names the directory (and the tag) to give instead. `ds_consolidate` asks it too, for a rank's folder (one
stage of a pipeline is not the model); a tag folder it reads in place (located.py).
`FAMILIES` is the table of model-parallel folder names, shared with runtime.parallel.folders.
"""

from __future__ import annotations

import os
import re

from runtime.checkpoint.manifest import MANIFEST, CheckpointNotFound

# folder prefix -> (what it was saved with, what this engine lacks, how to resume); {} is the degree
FAMILIES = (
    (
        "tp_rank_",
        "tensor-parallel degree {}",
        "tensor parallelism",
        '"tensor_parallel": {{"autotp_size": {}}}',
    ),
    ("pipe_stage_", "{} pipeline stages", "pipeline", "a PipelineModule of num_stages={}"),
    ("mp_rank_", "model-parallel size {}", "model parallelism", "initialize(mpu=...) of model size {}"),
)


FOLDER = re.compile(r"(\d+)_of_(\d+)")  # after the prefix: this rank's index and the degree


def misplaced_root(
    root: str | os.PathLike, call: str = "load_checkpoint", *, tag: str | None = None
) -> Exception | None:
    """The error for a path one level inside a checkpoint directory, where the directory was meant: one
    tag's folder (it holds a manifest), or one model-parallel rank's folder (`pipe_stage_00_of_02`); None
    for anything else. Every engine's load can ask this before looking for its own folders; `call` names the
    function or command the messages suggest ("load_checkpoint", "ds_consolidate"), and `tag` the tag asked
    for, which the suggestion for a model-parallel rank's folder repeats."""
    path = os.fspath(root)
    if not os.path.isdir(path):
        return None
    parent, name = os.path.split(os.path.normpath(path))
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return CheckpointNotFound(
            f"{path} is the folder of one checkpoint (tag {name!r}), not a checkpoint directory: "
            f"{call} takes the directory save_checkpoint was given",
            hint=_suggest(call, parent, name),
        )
    for prefix, saved_with, _lacks, _resume in FAMILIES:
        match = FOLDER.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
        if match is not None:
            return CheckpointNotFound(
                f"{path} is one rank's part of a checkpoint saved with "
                f"{saved_with.format(int(match.group(2)))}, not a checkpoint directory: {call} "
                "takes the directory save_checkpoint was given",
                hint=_suggest(call, parent, tag),
            )
    return None


def _suggest(call: str, parent: str, tag: str | None) -> str:
    if call.startswith("ds_"):  # a command line
        return f"{call} {parent} --tag {tag} ..." if tag else f"{call} {parent} ..."
    if tag is None:
        return f"{call}({parent!r})"
    return f"{call}({parent!r}, tag={tag!r}), or {call}({parent!r}) for its latest tag"


__all__ = ["FAMILIES", "FOLDER", "misplaced_root"]
