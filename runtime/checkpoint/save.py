"""engine.save_checkpoint: every rank writes its shard in parallel, beside the last complete checkpoint,
and the new one replaces it only when every byte of it is durable, on every rank.

Order, and why:
1. All ranks agree on the directory and the tag (a rank saving elsewhere would split the checkpoint), and
   every rank's master weights are finite (a NaN checkpoint cannot be resumed and must not move `latest`);
   a disagreement or a NaN on any rank stops every rank before anything is written.
2. World rank 0 finishes the swap of a committed save that a crash interrupted; the rank 0 of each part
   (the save directory, or a pipeline stage's or tensor-parallel rank's folder in it) removes what
   uncommitted saves left and creates the staging folder `.<tag>~new`.
3. Every rank writes its shard file there: temporary name, fsync, rename, fsync directory. The file
   records (size, CRC-32, flat ranges) and per-rank RNG states are gathered on the part's rank 0, which
   writes the engine state file, a tensor-free `zero_pp_rank_R_mp_rank_00_optim_states.pt` per rank for
   DeepSpeed's tools (engine_state.deepspeed_descriptor), and then the manifest, each the same durable way.
4. The commit (runtime.checkpoint.commit): world rank 0 writes the commit record, each part's rank 0
   swaps its staging folder in under the tag's name and writes `latest`, world rank 0 removes the record.

Every step runs through `agreed`, over all ranks of the save, so a failure anywhere is the same error
everywhere, before the next step; a refused write (full disk, read-only or immutable folder, a file in
the way) is a `CheckpointWriteError` naming the path and the cause. A process killed before the commit
record leaves the previous checkpoint untouched (a failed save removes its staging folder, the next save
removes what a killed one left); killed after it, the new checkpoint loads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from runtime.checkpoint import commit, engine_state
from runtime.checkpoint.agree import agree_on_location, agreed, all_gather_objects
from runtime.checkpoint.durable import DurableFile, fault_point, os_error_cause, write_text_durably
from runtime.checkpoint.manifest import (
    COMMIT_RECORD,
    ENGINE_STATE,
    LATEST,
    MANIFEST,
    MASTER_KEY,
    CheckpointError,
    CheckpointRefused,
    CheckpointWriteError,
    FileEntry,
    GroupEntry,
    Manifest,
    ModuleKey,
    ParamEntry,
    PendingCommit,
    check_tag,
    read_latest,
    shard_file_name,
    staging_name,
    tensor_name,
)
from runtime.checkpoint.recovery_script import write_recovery_script
from runtime.checkpoint.shards import Piece, optimizer_state, saved_pieces
from runtime.checkpoint.tensorfile import TensorFileWriter

if TYPE_CHECKING:  # annotations only: the engine imports this package
    from runtime.engine import Engine

_log = logging.getLogger("runtime.checkpoint")
T = TypeVar("T")


def save_checkpoint(
    engine: Engine,
    save_dir: str | os.PathLike[str],
    tag: str | None = None,
    client_state: Mapping[str, Any] | None = None,
    save_latest: bool = True,
) -> Path:
    """Save the engine's full training state under `save_dir/<tag>` (under `save_dir/<part>/<tag>` for a
    model-parallel engine: see `engine.checkpoint_folder`); all ranks must call it. Returns the tag
    directory."""
    comm = engine.comm
    ranks = commit.save_ranks(engine)
    if engine.config.checkpoint.use_node_local_storage:
        raise CheckpointError(
            "checkpoint.use_node_local_storage is not supported: save_dir must be one filesystem that "
            "every rank sees (shards are resharded on load, so every rank may read any of them)"
        )
    given = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    root, agreed_tag = agree_on_location(
        ranks, save_dir, given, policy=engine.config.checkpoint.tag_validation, what="save_checkpoint"
    )
    tag = check_tag(str(agreed_tag))  # the same verdict on every rank
    name = commit.part_name(engine)
    part = root / name
    if engine.micro_steps % engine.gradient_accumulation_steps() and comm.rank == 0:
        _log.warning(
            "save_checkpoint inside a gradient accumulation window: the gradients accumulated so far "
            "are not saved"
        )

    def step(fn: Callable[[], T], *, committed: bool = False) -> T:
        """`fn` on every rank, a failure anywhere raised everywhere; a refused write named in one line."""
        return agreed(ranks, lambda: _named_write_errors(fn, root, part, tag, committed=committed))

    # refused before anything is written: a client_state that torch.load(weights_only=True) cannot read
    step(lambda: engine_state.check_loadable(dict(client_state or {}), "client_state"))
    step(lambda: refuse_non_finite(engine, part, tag))
    fault_point("start")
    step(lambda: _finish_interrupted(root) if ranks.rank == 0 else None)
    step(lambda: commit.prepare_staging(part, tag) if comm.rank == 0 else None)
    staging = part / staging_name(tag)
    try:
        plan = [
            (group, saved_pieces(group.layout, group.rank, comm.world_size, comm.rank))
            for group in engine.groups
        ]
        states = step(lambda: [optimizer_state(engine, group) for group in engine.groups])
        shard = step(lambda: _write_shard(staging, tag, comm.rank, plan, states))
        rng = engine_state.capture_rng(engine.device, engine.rng_tracker)
        records = all_gather_objects(comm, (shard, rng))

        def finish_part() -> None:
            if comm.rank != 0:
                return
            state = engine_state.capture(
                engine,
                client_state=client_state or {},
                rng_states=[rng for _, rng in records],
                optimizer_scalars=[scalars for _, scalars in states],
            )
            # torch types its file argument as IO[bytes] but only writes and flushes, all DurableFile has
            with DurableFile(staging / ENGINE_STATE) as out:
                torch.save(state, out)  # type: ignore[arg-type]
                fault_point("engine_state")
                engine_record = out.commit()
            for rank in range(comm.world_size):  # DeepSpeed's per-rank file names, for its tools
                with DurableFile(staging / engine_state.deepspeed_optim_name(rank)) as out:
                    torch.save(engine_state.deepspeed_descriptor(engine, rank), out)  # type: ignore[arg-type]
                    out.commit()
            manifest = _manifest(engine, tag, [r for r, _ in records], engine_record, states)
            fault_point("manifest")
            write_text_durably(staging / MANIFEST, manifest.to_json())

        step(finish_part)
        parts = tuple(sorted(set(all_gather_objects(ranks, name))))
        record = PendingCommit(tag, save_latest, parts)
        step(lambda: commit.write_commit(root, record) if ranks.rank == 0 else None)
    except BaseException:
        if comm.rank == 0 and not (root / COMMIT_RECORD).exists():
            commit.discard_staging(part, tag)  # every rank has left the failed step: nothing writes there
        raise
    swap = lambda: commit.swap_in(part, tag, move_latest=save_latest) if comm.rank == 0 else None  # noqa: E731
    step(swap, committed=True)
    step(lambda: commit.clear_commit(root) if ranks.rank == 0 else None, committed=True)
    # files that go beside the checkpoints (once `latest` names the new one) are written from here on
    step(lambda: write_recovery_script(part) if comm.rank == 0 else None, committed=True)  # zero_to_fp32.py
    return part / tag


def check_save_dir(save_dir: str | os.PathLike[str]) -> Path:
    """Check, before training, that checkpoints can be saved in `save_dir`: it is a folder or can be made
    one (no file in the way), and a file can be created in it (not read-only, immutable or someone
    else's). Creates the folder; raises a one-line `CheckpointWriteError` naming the path and the cause.
    A full disk shows only when a save writes; that save fails the same way and keeps the last checkpoint."""
    root = Path(os.path.abspath(os.fspath(save_dir)))
    probe = root / f".dslaunch-write-check-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        probe.unlink()
    except OSError as error:
        cause, hint = os_error_cause(error)
        raise CheckpointWriteError(f"cannot save checkpoints in {root}: {cause}", hint=hint) from None
    return root


def _finish_interrupted(root: Path) -> None:
    if not root.is_dir():
        return
    done = commit.finish_interrupted(root)
    if done:
        _log.warning("%s", done)


def _named_write_errors(fn: Callable[[], T], root: Path, part: Path, tag: str, *, committed: bool) -> T:
    """Run `fn`; an OSError from the filesystem becomes a `CheckpointWriteError` naming the path, the
    cause (ENOSPC, EROFS, ...) and what became of the last complete checkpoint."""
    try:
        return fn()
    except OSError as error:
        cause, hint = os_error_cause(error)
        if committed:
            kept = (
                f"checkpoint {tag!r} is complete and committed: loading {root} uses it, and the next save "
                "finishes swapping it in"
            )
        else:
            try:
                latest = read_latest(part)
            except (OSError, CheckpointError):
                latest = None
            kept = (
                f"{part / LATEST} still names {latest!r}, which is untouched"
                if latest
                else "no earlier checkpoint was touched"
            )
        raise CheckpointWriteError(
            f"cannot save checkpoint {tag!r} in {root}: {cause}; {kept}", hint=hint
        ) from None


def refuse_non_finite(engine: Engine, root: Path, tag: str) -> None:
    """Raise when this rank's master weights (the weights themselves where no separate master exists)
    hold NaN or inf: such a checkpoint could never be resumed, and saving it would move `latest` off the
    last good one. Run through `agreed`, so one rank's verdict stops every rank's save."""
    for group in engine.groups:
        master = group.master.detach()
        if bool(torch.isfinite(master).all()):  # one reduction per group; the usual case ends here
            continue
        names = engine_state.param_names(engine, group)
        for piece in group.layout.param_pieces(group.rank):
            values = master.narrow(0, piece.shard_offset, piece.numel)
            if not bool(torch.isfinite(values).all()):
                latest = read_latest(root)
                kept = f"{root / LATEST} still names {latest!r}" if latest else "no earlier checkpoint exists"
                raise CheckpointRefused(
                    f"not saving checkpoint {tag!r} at step {engine.global_steps}: parameter "
                    f"{names[piece.param]!r} holds NaN or inf (rank {engine.comm.rank}'s shard); {kept}",
                    hint="the weights diverged: resume from the last good checkpoint with a lower learning "
                    "rate or gradient_clipping set",
                )
        # only the padding between parameters is non-finite: it is never read back


def _write_shard(
    tag_dir: Path,
    tag: str,
    rank: int,
    plan: list[tuple[Any, list[Piece]]],
    states: list[tuple[dict[str, torch.Tensor], dict[str, Any]]],
) -> FileEntry:
    if not tag_dir.is_dir():
        raise CheckpointError(
            f"{tag_dir} (created by rank 0) does not exist on rank {rank}'s host: save_dir must be a "
            "filesystem shared by all ranks"
        )
    declared = []
    sources: list[tuple[str, torch.Tensor, list[Piece]]] = []
    for position, ((group, pieces), (tensors, _)) in enumerate(zip(plan, states, strict=True)):
        numel = sum(p.numel for p in pieces)
        for key, tensor in [(MASTER_KEY, group.master.detach()), *sorted(tensors.items())]:
            name = tensor_name(position, key)
            declared.append((name, tensor.dtype, (numel,)))
            sources.append((name, tensor, pieces))
    path = tag_dir / shard_file_name(rank)
    metadata = {"format": "dslaunch-zero-shard", "tag": tag, "rank": str(rank)}
    with TensorFileWriter(path, declared, metadata) as writer:
        for i, (name, tensor, pieces) in enumerate(sources):
            for piece in pieces:
                writer.write(name, tensor.detach().narrow(0, piece.shard_offset, piece.numel))
            if i == 0:
                fault_point("shard")  # part of the file is written under its temporary name
        record = writer.commit()
    ranges = tuple(tuple((p.flat_start, p.flat_end) for p in pieces) for _, pieces in plan)
    return FileEntry(record.name, "shard", rank, record.size, record.crc32, ranges)


def _manifest(
    engine: Engine,
    tag: str,
    shards: list[FileEntry],
    engine_record: Any,
    states: list[tuple[dict[str, torch.Tensor], dict[str, Any]]],
) -> Manifest:
    groups = []
    for group in engine.groups:
        names = engine_state.param_names(engine, group)
        params = tuple(
            ParamEntry(name, tuple(param.shape), slot.offset)
            for name, param, slot in zip(names, group.params, group.layout.slots, strict=True)
        )
        groups.append(GroupEntry(engine_state.spec_index(group), group.layout.numel, params))
    state_keys = sorted({key for tensors, _ in states for key in tensors})
    state_dtypes = {
        key: str(tensors[key].dtype).removeprefix("torch.") for tensors, _ in states for key in tensors
    }
    optimizer = engine.optimizer
    return Manifest(
        tag=tag,
        world_size=engine.comm.world_size,
        zero_stage=engine.zero_stage,
        param_dtype=str(engine.policy.param_dtype).removeprefix("torch."),
        master_dtype=str(engine.groups[0].master.dtype).removeprefix("torch.")
        if engine.groups
        else "float32",
        groups=tuple(groups),
        files=(
            *shards,
            FileEntry(engine_record.name, "engine_state", 0, engine_record.size, engine_record.crc32),
        ),
        module_keys=tuple(ModuleKey(key, name) for key, name in engine_state.module_keys(engine)),
        optimizer_class=None
        if optimizer is None
        else f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        optimizer_state_keys=tuple(state_keys),
        state_dtypes=state_dtypes,
    )
