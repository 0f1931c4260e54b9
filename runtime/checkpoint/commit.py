"""Staging and swapping in: a save never touches the last complete checkpoint until the new one is whole.

Every rank writes its files of tag T into a staging folder `.T~new` beside `T` (in every part folder of a
model-parallel engine). Once the staging folder of every part is complete on every rank (shards, engine
state, manifest), world rank 0 writes the commit record `.checkpoint-commit.json` into the save
directory, durably. That write is the commit: from then on the new save is the checkpoint, wherever the
swap stands. The rank 0 of each part then swaps its folder in:

1. rename `T` aside to `.T~old` (rename(2) cannot replace a non-empty folder, so the old one moves first),
2. rename `.T~new` to `T`,
3. write `latest` (atomically, as every file),
4. remove `.T~old`;

and world rank 0 removes the record once every part is done. Readers honour a record they find
(`manifest.pending_commit`): its tag's staging folder stands in for the tag while that part is not
swapped, and the tag is `latest` if the save moves it. So a crash before the record leaves the previous
checkpoint as it was (a save of a new tag, or the overwrite of one, alike), and a crash after it leaves
the new one loadable: never neither, and never one part old and another new. The next save first
finishes the swap a record describes (`finish_interrupted`), then removes staging folders no record
covers (`remove_leftovers`): those are saves that never committed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from runtime.checkpoint.durable import fault_point, fsync_dir, write_text_durably
from runtime.checkpoint.manifest import (
    COMMIT_RECORD,
    LATEST,
    PendingCommit,
    aside_name,
    pending_commit,
    read_commit,
    staged_tag,
    staging_name,
)

if TYPE_CHECKING:  # annotations only: the engine imports this package
    from runtime.engine import Engine

_log = logging.getLogger("runtime.checkpoint")


@dataclass(frozen=True)
class Ranks:
    """The ranks of one save, for `agree.agreed`: a rank, their number and their process group."""

    rank: int
    world_size: int
    group: Any = None  # None: the default (world) group


def save_ranks(engine: Engine) -> Any:
    """The ranks that save into one checkpoint directory: the engine's data-parallel group, or the whole
    job when each model-parallel part (pipeline stage, tensor-parallel rank) keeps its own folder there;
    they agree on every step, so that the parts commit together."""
    if engine.checkpoint_folder() is None:
        return engine.comm
    if not dist.is_available() or not dist.is_initialized():
        return Ranks(0, 1)
    return Ranks(dist.get_rank(), dist.get_world_size())


def part_name(engine: Engine) -> str:
    """This rank's part folder inside the save directory ("." for the directory itself)."""
    folder = engine.checkpoint_folder()
    return "." if folder is None else folder[0]


def prepare_staging(part: Path, tag: str) -> Path:
    """Create the part folder and an empty staging folder for `tag` in it (the part's rank 0)."""
    part.mkdir(parents=True, exist_ok=True)
    for name in remove_leftovers(part):
        _log.warning("removed %s: left by a save that stopped before it was complete", part / name)
    staging = part / staging_name(tag)
    staging.mkdir()
    fsync_dir(part)
    return staging


def remove_leftovers(folder: Path) -> list[str]:
    """Remove the staging folders and temporary files of saves that never committed; none while a
    committed save covers `folder` (its staging folder is the checkpoint until it is swapped in)."""
    if pending_commit(folder) is not None:
        return []
    removed = []
    ours = (f".{LATEST}.tmp-", f".{COMMIT_RECORD}.tmp-")  # durable.DurableFile's temporary names
    for path in sorted(folder.iterdir()):
        temporary = path.name.startswith(ours) and not path.is_dir()
        if temporary or (staged_tag(path.name) is not None and path.is_dir()):
            _remove(path)
            removed.append(path.name)
    return removed


def discard_staging(part: Path, tag: str) -> None:
    """After a failed save (before its commit): remove what it wrote, best effort (the disk may be full or
    read-only, which may be why it failed; the next save removes what is left)."""
    with contextlib.suppress(OSError):
        _remove(part / staging_name(tag))


def write_commit(root: Path, commit: PendingCommit) -> None:
    """The commit point (world rank 0): every part's staging folder is complete."""
    write_text_durably(root / COMMIT_RECORD, commit.to_json())
    fault_point("commit")


def clear_commit(root: Path) -> None:
    """Every part is swapped in (world rank 0)."""
    with contextlib.suppress(FileNotFoundError):
        (root / COMMIT_RECORD).unlink()
    fsync_dir(root)


def swap_in(part: Path, tag: str, *, move_latest: bool) -> None:
    """Make the staging folder of `tag` the tag and (if asked) `latest` (the part's rank 0, after the
    commit). Each step is checked first, so repeating it after a crash at any point finishes the job."""
    staging, current, aside = part / staging_name(tag), part / tag, part / aside_name(tag)
    if staging.is_dir():
        if current.exists():
            if aside.exists():  # an aside no record covered: replaced by the one made now
                _remove(aside)
            os.rename(current, aside)
            fsync_dir(part)
            fault_point("swap")  # between the renames: readers take the staging folder for the tag
        os.rename(staging, current)
        fsync_dir(part)
    fault_point("latest")
    if move_latest:
        write_text_durably(part / LATEST, tag)
    fault_point("cleanup")
    if aside.exists():
        _remove(aside)


def finish_interrupted(root: Path) -> str | None:
    """Finish the swap of a committed save that a crash interrupted (world rank 0, before a new save
    writes anything); returns what it did, in words, or None when there was nothing to finish."""
    commit = read_commit(root)
    if commit is None:
        return None
    for part in commit.parts:
        swap_in(root / part, commit.tag, move_latest=commit.latest)
    clear_commit(root)
    where = "" if commit.parts == (".",) else f" ({', '.join(commit.parts)})"
    return (
        f"finished swapping in checkpoint {commit.tag!r} in {root}{where}: that save was complete and "
        "committed when its process stopped"
    )


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
