"""engine.save_checkpoint: every rank writes its shard in parallel; the tag becomes `latest` only when
every byte of it is durable and described by a manifest.

Order, and why:
1. All ranks agree on the directory and the tag (a rank saving elsewhere would split the checkpoint), and
   every rank's master weights are finite (a NaN checkpoint cannot be resumed and must not move `latest`);
   a disagreement or a NaN on any rank stops every rank before anything is written.
2. Rank 0 removes the manifest of a previous save under the same tag (that tag is incomplete while it is
   rewritten), then every rank writes its shard file: temporary name, fsync, rename, fsync directory.
3. The file records (size, CRC-32, flat ranges) and per-rank RNG states are gathered on rank 0, which
   writes the engine state file, then the manifest, then `latest`, each the same durable way.
4. A final agreement: every rank returns only once `latest` names the new tag, or raises.

A process killed anywhere in 2-3 leaves `latest` naming the previous complete tag; the new tag has no
manifest and refuses to load.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from runtime.checkpoint import engine_state
from runtime.checkpoint.agree import agree_on_location, agreed, all_gather_objects
from runtime.checkpoint.durable import DurableFile, fault_point, fsync_dir, write_text_durably
from runtime.checkpoint.manifest import (
    ENGINE_STATE,
    LATEST,
    MANIFEST,
    MASTER_KEY,
    CheckpointError,
    CheckpointRefused,
    FileEntry,
    GroupEntry,
    Manifest,
    ModuleKey,
    ParamEntry,
    check_tag,
    read_latest,
    shard_file_name,
    tensor_name,
)
from runtime.checkpoint.recovery_script import write_recovery_script
from runtime.checkpoint.shards import Piece, optimizer_state, saved_pieces
from runtime.checkpoint.tensorfile import TensorFileWriter

_log = logging.getLogger("runtime.checkpoint")


def save_checkpoint(
    engine: Any,
    save_dir: str | os.PathLike[str],
    tag: str | None = None,
    client_state: Mapping[str, Any] | None = None,
    save_latest: bool = True,
) -> Path:
    """Save the engine's full training state under `save_dir/<tag>`; all ranks must call it."""
    comm = engine.comm
    if engine.config.checkpoint.use_node_local_storage:
        raise CheckpointError(
            "checkpoint.use_node_local_storage is not supported: save_dir must be one filesystem that "
            "every rank sees (shards are resharded on load, so every rank may read any of them)"
        )
    given = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    root, agreed_tag = agree_on_location(
        comm, save_dir, given, policy=engine.config.checkpoint.tag_validation, what="save_checkpoint"
    )
    tag = check_tag(str(agreed_tag))  # the same verdict on every rank
    tag_dir = root / tag
    if engine.micro_steps % engine.gradient_accumulation_steps() and comm.rank == 0:
        _log.warning(
            "save_checkpoint inside a gradient accumulation window: the gradients accumulated so far "
            "are not saved"
        )

    # refused before anything is written: a client_state that torch.load(weights_only=True) cannot read
    agreed(comm, lambda: engine_state.check_loadable(dict(client_state or {}), "client_state"))
    agreed(comm, lambda: refuse_non_finite(engine, root, tag))
    agreed(comm, lambda: _prepare(root, tag_dir, comm.rank))
    plan = [
        (group, saved_pieces(group.layout, group.rank, comm.world_size, comm.rank)) for group in engine.groups
    ]
    states = agreed(comm, lambda: [optimizer_state(engine, group) for group in engine.groups])
    shard = agreed(comm, lambda: _write_shard(tag_dir, tag, comm.rank, plan, states))
    records = all_gather_objects(comm, (shard, engine_state.capture_rng(engine.device)))

    def finish() -> None:
        if comm.rank != 0:
            return
        state = engine_state.capture(
            engine,
            client_state=client_state or {},
            rng_states=[rng for _, rng in records],
            optimizer_scalars=[scalars for _, scalars in states],
        )
        with DurableFile(tag_dir / ENGINE_STATE) as out:
            torch.save(state, out)
            fault_point("engine_state")
            engine_record = out.commit()
        manifest = _manifest(engine, tag, [r for r, _ in records], engine_record, states)
        fault_point("manifest")
        write_text_durably(tag_dir / MANIFEST, manifest.to_json())
        _remove_strays(tag_dir, manifest)
        fault_point("latest")
        if save_latest:
            write_text_durably(root / LATEST, tag)
        write_recovery_script(root)  # zero_to_fp32.py beside `latest`, as DeepSpeed writes it

    agreed(comm, finish)
    return tag_dir


def refuse_non_finite(engine: Any, root: Path, tag: str) -> None:
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


def _prepare(root: Path, tag_dir: Path, rank: int) -> None:
    if rank != 0:
        return
    root.mkdir(parents=True, exist_ok=True)
    tag_dir.mkdir(exist_ok=True)
    fsync_dir(root)  # the tag directory's own entry
    old = tag_dir / MANIFEST
    if old.exists():
        if read_latest(root) == tag_dir.name:
            _log.warning(
                "overwriting tag %r, which %s names: until this save finishes there is no complete "
                "checkpoint to resume from", tag_dir.name, root / LATEST,
            )  # fmt: skip
        old.unlink()
        fsync_dir(tag_dir)


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
    engine: Any,
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


def _remove_strays(tag_dir: Path, manifest: Manifest) -> None:
    """Files of an earlier save under this tag that the new manifest does not list (e.g. more ranks)."""
    keep = {f.name for f in manifest.files} | {MANIFEST}
    for path in tag_dir.iterdir():
        stray_shard = path.name.startswith("zero_pp_rank_") and path.name not in keep
        if stray_shard or (path.name.startswith(".") and ".tmp-" in path.name):
            path.unlink(missing_ok=True)
