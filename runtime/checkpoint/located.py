"""Where a checkpoint is, from the folder a user gives a reading tool: the forms users pass, or one line.

The readers that turn a checkpoint into one state dict (`get_fp32_state_dict_from_checkpoint`,
`ds_consolidate`, and the `zero_to_fp32` names above them in fp32_state) take `locate`'s answer:

- the directory save_checkpoint was given, its `latest` naming the tag (or a `tag`): read as it is;
- one tag's folder (our manifest, or DeepSpeed's files in it), alone or with its own name as the tag:
  read in place, as its parent with that tag (DeepSpeed's tools are given the tag folder too, and the
  standalone zero_to_fp32.py reads it);
- a pipeline checkpoint's root (`pipe_stage_SS_of_NN/`, each with its own `latest`): its stage folders,
  in stage order, whose state dicts the reader merges;
- a tensor-parallel or model-parallel root: refused, naming the degree (its shards are not merged);
- a tag folder with another tag, or a folder without `latest`: refused, naming the folder and the tags
  found there (runtime.checkpoint.manifest.resolve_tag_dir).

An engine's `load_checkpoint` keeps refusing a tag folder (misplaced.py): a resumed run saves into the
directory it loaded from, so it must be the directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from runtime.checkpoint.deepspeed_format import as_checkpoint_error
from runtime.checkpoint.manifest import (
    LATEST,
    MANIFEST,
    CheckpointMismatch,
    CheckpointNotFound,
    complete_tags,
)
from runtime.checkpoint.portable_folders import (
    RecoveryError,
    is_deepspeed_tag,
    model_parallel_root,
    pipeline_stages,
)

__all__ = ["Located", "locate"]


@dataclass(frozen=True)
class Located:
    """The checkpoint directory and tag to read; `stages`: a pipeline root's stage folders (then `root` is
    that root, and `tag` is looked up in every stage folder)."""

    root: Path
    tag: str | None
    stages: tuple[Path, ...] = ()


def locate(checkpoint_dir: str | os.PathLike[str], tag: str | None = None) -> Located:
    """The (directory, tag) to read for what a user passed (module docstring); a missing directory or
    tag is left for the reader's own message (resolve_tag_dir)."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return Located(root, tag)
    if not (root / LATEST).is_file() and ((root / MANIFEST).is_file() or is_deepspeed_tag(root)):
        if tag is None or tag == root.name:
            return Located(root.parent, root.name)  # a tag folder given directly
        found = complete_tags(root.parent)
        raise CheckpointNotFound(
            f"{root} is the folder of checkpoint tag {root.name!r}, not of tag {tag!r}",
            hint=f"pass the directory holding the tags, {root.parent}, with tag {tag!r}"
            + (f" (tags there: {', '.join(found)})" if found else ""),
        )
    parallel = model_parallel_root(root)
    if parallel is not None:
        what, degree = parallel
        raise CheckpointMismatch(
            f"{root} is a {what} checkpoint ({what} degree {degree}, one sub-folder per rank): its "
            "shards are not merged into one state dict",
            hint="load it with the same degree and save the full weights with engine.save_16bit_model, "
            "or consolidate one rank's sub-folder",
        )
    try:
        stages = pipeline_stages(root)
    except RecoveryError as error:  # a stage folder missing, or pipeline x tensor parallelism
        raise as_checkpoint_error(error) from None
    return Located(root, tag, tuple(stages))
