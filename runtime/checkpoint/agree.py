"""Collective agreement for checkpoint steps: a failure on one rank becomes the same error on every rank.

Saving and loading interleave local work (writing a shard, checking a file) with collectives. If one rank
raised while the others went on to the next collective, the job would hang instead of failing. Every
local step therefore runs through `agreed`: each rank catches its own error, all ranks exchange what
happened, and if any rank failed, every rank raises the error of the lowest failing rank. An error in the
user's input (a damaged file, a wrong path: a `UserError`) is raised with the same class, words and hint
on every rank, so the launcher folds the ranks' failures into one line; any other failure stays itself
on the rank where it happened, and the others raise `PeerFailed` naming that rank.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from runtime.checkpoint import manifest as _manifest
from runtime.checkpoint.manifest import CheckpointError
from runtime.checkpoint.tensorfile import TensorFileError
from runtime.errors import UserError

T = TypeVar("T")
_log = logging.getLogger("runtime.checkpoint")

_ERRORS: dict[str, type[UserError]] = {
    cls.__name__: cls
    for cls in (
        CheckpointError,
        _manifest.CheckpointNotFound,
        _manifest.CheckpointIncomplete,
        _manifest.CheckpointCorrupted,
        _manifest.CheckpointMismatch,
        _manifest.CheckpointRefused,
        _manifest.CheckpointWriteError,
        TensorFileError,
    )
}


class PeerFailed(RuntimeError):
    """Another rank failed in a checkpoint step with an error that is not the user's input."""


def all_gather_objects(comm: Any, obj: Any) -> list[Any]:
    """`obj` from every rank, in rank order."""
    if comm.world_size == 1:
        return [obj]
    out: list[Any] = [None] * comm.world_size
    dist.all_gather_object(out, obj, group=comm.group)
    return out


def rank_ranges(ranks: list[int]) -> str:
    """Sorted ranks as ranges: [0, 1, 2, 3, 5, 7, 8] -> "0-3,5,7-8"."""
    parts: list[str] = []
    ordered = sorted(ranks)
    start = prev = ordered[0] if ordered else 0
    for rank in [*ordered[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return ",".join(parts) if ordered else ""


def by_rank(values: list[Any]) -> str:
    """Each distinct value with the ranks that gave it: "ranks 0,2: /a/x; rank 1: /a/y"."""
    groups: dict[Any, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return "; ".join(
        f"{'ranks' if len(ranks) > 1 else 'rank'} {rank_ranges(ranks)}: {value}"
        for value, ranks in groups.items()
    )


def agree_on_location(
    comm: Any, directory: str | os.PathLike[str], tag: str | None, *, policy: str, what: str
) -> tuple[Path, str | None]:
    """The directory and tag every rank uses, checked before anything is written or read.

    Ranks must name the same directory (as an absolute path): the shards of one checkpoint would
    otherwise scatter over several folders. Different tags follow the config's `checkpoint.tag_validation`
    (DeepSpeed's key): FAIL refuses, WARN (the default) warns and uses rank 0's, IGNORE uses rank 0's.
    `what` names the call for messages: "save_checkpoint" or "load_checkpoint".
    """
    root = Path(os.path.abspath(os.fspath(directory)))
    places = all_gather_objects(comm, (str(root), tag))
    argument = "save_dir" if what == "save_checkpoint" else "load_dir"
    shared = (
        "derive them from values every rank has (a run name fixed before the launch, the step), not from "
        "the clock or the host, or decide on rank 0 and broadcast"
    )
    if len({d for d, _ in places}) > 1:
        raise _manifest.CheckpointRefused(
            f"ranks passed different {argument} values to {what} ({by_rank([d for d, _ in places])}); "
            "every rank must use the same directory",
            hint=f"pass the same {argument} and tag on every rank: {shared}",
        )
    tags = [t for _, t in places]
    if len(set(tags)) == 1:
        return root, tag
    detail = by_rank([repr(t) for t in tags])
    if policy.upper() == "FAIL":
        raise _manifest.CheckpointRefused(
            f"ranks passed different checkpoint tags to {what} ({detail})",
            hint=f"pass the same tag on every rank ({shared}), or set checkpoint.tag_validation to WARN",
        )
    if policy.upper() == "WARN" and comm.rank == 0:
        _log.warning("ranks passed different checkpoint tags to %s (%s); using rank 0's", what, detail)
    return root, tags[0]


def agreed(comm: Any, fn: Callable[[], T]) -> T:
    """Run `fn` on every rank; if it raised anywhere, raise the first failing rank's error everywhere."""
    result: Any = None
    failure: tuple[str, str, str | None] | None = None
    try:
        result = fn()
    except Exception as error:  # any failure: the other ranks must hear of it, not hang
        hint = error.hint if isinstance(error, UserError) else None
        failure = (type(error).__name__, str(error), hint)
        local = error
    outcomes = all_gather_objects(comm, failure)
    for rank, outcome in enumerate(outcomes):
        if outcome is None:
            continue
        if rank == comm.rank and failure is not None:
            raise local
        name, message, hint = outcome
        if hint is None:
            raise PeerFailed(f"rank {rank} failed: {name}: {message}")
        raise _ERRORS.get(name, CheckpointError)(message, hint=hint)
    return result
