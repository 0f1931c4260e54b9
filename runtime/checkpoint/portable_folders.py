"""Which checkpoint a folder path names, for the standalone `zero_to_fp32.py` and the runtime's readers: a
save directory with `latest`, one tag's folder given directly, a half swapped-in save (the commit record's
tag), DeepSpeed's tag folders, a pipeline root's stage folders, and the model-parallel roots that cannot be
merged into one state dict. `RecoveryError` is the one error of the portable readers.

Part of the standalone script (runtime.checkpoint.recovery_script: the first module of it after the pure
index math), so it imports only the standard library, never dslaunch.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

MANIFEST = "manifest.json"
LATEST = "latest"
COMMIT_RECORD = ".checkpoint-commit.json"  # runtime.checkpoint.manifest's names, repeated: no dslaunch here
_DS_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_DS_MODEL3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_PIPE = re.compile(r"^pipe_stage_(\d+)_of_(\d+)(?:_chunks_\d+)?(_tp_(\d+)_of_(\d+))?$")
_TP = re.compile(r"^tp_rank_(\d+)_of_(\d+)$")
_DS_MP = re.compile(r"^mp_rank_(\d+)_of_(\d+)$")


class RecoveryError(Exception):
    """A checkpoint that cannot be read; `kind` is not_found | incomplete | corrupted | refused."""

    def __init__(self, message: str, kind: str = "corrupted") -> None:
        super().__init__(message)
        self.kind = kind


def is_deepspeed_tag(tag_dir: Path) -> bool:
    """DeepSpeed's files and no manifest of ours: never one of our unfinished saves."""
    if (tag_dir / MANIFEST).exists() or not tag_dir.is_dir():
        return False
    names = [p.name for p in tag_dir.iterdir()]
    if any(n.endswith(".safetensors") for n in names):
        return False
    return (
        any(_DS_OPTIM.match(n) or _DS_MODEL3.match(n) for n in names) or "mp_rank_00_model_states.pt" in names
    )


def model_parallel_root(root: Path) -> tuple[str, int] | None:
    """(what, degree) when `root` holds per-rank model-parallel sub-folders instead of a checkpoint."""
    names = [p.name for p in root.iterdir()] if root.is_dir() else []
    for pattern, what in ((_TP, "tensor-parallel"), (_DS_MP, "model-parallel")):
        found = [m for n in names if (m := pattern.match(n))]
        if found:
            return what, int(found[0].group(2))
    return None


def pipeline_stages(root: Path) -> list[Path]:
    stages = {}
    for p in root.iterdir() if root.is_dir() else []:
        m = _PIPE.match(p.name)
        if m:
            if m.group(3):
                raise RecoveryError(
                    f"{root} is a pipeline checkpoint with tensor parallelism (tensor-parallel degree "
                    f"{int(m.group(5))}): its tensor-parallel shards are not merged into one state dict here",
                    "refused",
                )
            stages[int(m.group(1))] = (p, int(m.group(2)))
    if stages:
        degree = next(iter(stages.values()))[1]
        missing = [s for s in range(degree) if s not in stages]
        if missing:
            raise RecoveryError(
                f"{root}: pipeline stage {missing[0]} of {degree} is missing "
                f"(pipe_stage_{missing[0]:02d}_of_{degree:02d})"
            )
    return [stages[s][0] for s in sorted(stages)]


def resolve_tag(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> Path:
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise RecoveryError(f"checkpoint directory {root} does not exist", "not_found")
    latest = root / LATEST
    if not latest.is_file() and ((root / MANIFEST).is_file() or is_deepspeed_tag(root)):  # a tag folder
        if tag in (None, root.name):
            return root
        what = f"{root} is the folder of checkpoint tag {root.name!r}, not of {tag!r}"
        where = f"pass {root.parent} with -t {tag}{_tags_there(root.parent)}"
        raise RecoveryError(f"{what}; {where}", "not_found")
    if tag is None:
        if not latest.is_file():
            what = f"{root} has no '{LATEST}' file and is not a checkpoint tag folder"
            where = f"pass the folder that holds 'latest', or -t TAG{_tags_there(root)}"
            raise RecoveryError(f"{what}; {where}", "not_found")
        tag = latest.read_text(encoding="utf-8").strip()
        if not tag:
            raise RecoveryError(f"{latest} is empty")
    tag_dir = root / tag
    staged = root / f".{tag}~new"
    if _pending_tag(root) == tag and staged.is_dir():
        return staged  # a committed save a crash left half swapped in: its complete files are still here
    if not tag_dir.is_dir():
        where = _tags_there(root)
        raise RecoveryError(f"checkpoint tag {tag!r} not found: {tag_dir} does not exist{where}", "not_found")
    return tag_dir


def _tags_there(root: Path) -> str:
    """ "; tags there: a, b" (the folders of `root` holding a checkpoint), or "" when there are none."""
    tags = sorted(p.name for p in root.iterdir() if (p / MANIFEST).is_file() or is_deepspeed_tag(p))
    return f"; tags there: {', '.join(tags)}" if tags else ""


def _pending_tag(folder: Path) -> str | None:
    """The tag of a committed save not yet swapped in everywhere (runtime.checkpoint.commit's record, in
    the save directory: `folder` itself or the one above a part folder)."""
    for record_dir, part in ((folder, "."), (folder.parent, folder.name)):
        try:
            record = json.loads((record_dir / COMMIT_RECORD).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and part in (record.get("parts") or ()):
            return record.get("tag")
    return None
