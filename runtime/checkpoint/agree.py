"""Collective agreement for checkpoint steps: a failure on one rank becomes the same error on every rank.

Saving and loading interleave local work (writing a shard, checking a file) with collectives. If one rank
raised while the others went on to the next collective, the job would hang instead of failing. Every
local step therefore runs through `agreed`: each rank catches its own error, all ranks exchange what
happened, and if any rank failed, every rank raises the error of the lowest failing rank (same class,
with the rank named).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from runtime.checkpoint import manifest as _manifest
from runtime.checkpoint.manifest import CheckpointError

T = TypeVar("T")

_ERRORS: dict[str, type[CheckpointError]] = {
    cls.__name__: cls
    for cls in (
        CheckpointError,
        _manifest.CheckpointNotFound,
        _manifest.CheckpointIncomplete,
        _manifest.CheckpointCorrupted,
        _manifest.CheckpointMismatch,
    )
}


def all_gather_objects(comm: Any, obj: Any) -> list[Any]:
    """`obj` from every rank, in rank order."""
    if comm.world_size == 1:
        return [obj]
    out: list[Any] = [None] * comm.world_size
    dist.all_gather_object(out, obj, group=comm.group)
    return out


def agreed(comm: Any, fn: Callable[[], T]) -> T:
    """Run `fn` on every rank; if it raised anywhere, raise the first failing rank's error everywhere."""
    result: Any = None
    failure: tuple[str, str] | None = None
    try:
        result = fn()
    except Exception as error:  # any failure: the other ranks must hear of it, not hang
        failure = (type(error).__name__, str(error))
        local = error
    outcomes = all_gather_objects(comm, failure)
    for rank, outcome in enumerate(outcomes):
        if outcome is None:
            continue
        if rank == comm.rank and failure is not None:
            raise local
        name, message = outcome
        cls = _ERRORS.get(name, CheckpointError)
        where = f"rank {rank}: " if comm.world_size > 1 else ""
        raise cls(f"{where}{message}")
    return result
