"""engine.load_checkpoint: verify, then fill this rank's shard from whatever layout was saved.

Order, and why:
1. Check that every rank names the same directory and tag (`agree_on_location`), resolve the tag
   (`latest` or the given one) and read the manifest: missing pieces are clear errors. A folder written by
   DeepSpeed (its files, no manifest of ours) is described as a manifest by `deepspeed_format` and
   read through the same steps (it has no checksums: each file is checked as it is opened).
2. Verify every file's size and CRC-32 against the manifest, spread over the ranks (file i on rank
   i mod world); all ranks learn the verdict, so a corrupted or truncated file is the same error,
   naming it, everywhere. Nothing falls back to another tag.
3. Check the model against the checkpoint (names, shapes, optimizer groups) and plan every copy before
   changing anything, then read exactly the element ranges this rank's new shard needs: fp32 master
   weights and every optimizer state tensor, at any saved world size, stage or bucket layout.
4. Write the masters into the working weights (all-gathered for sharded stages), then restore buffers,
   counters, loss scaler, LR schedule, data position and RNG.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runtime.checkpoint import engine_state
from runtime.checkpoint.agree import agree_on_location, agreed
from runtime.checkpoint.deepspeed_format import is_deepspeed_tag, open_deepspeed
from runtime.checkpoint.durable import file_crc32
from runtime.checkpoint.manifest import (
    ENGINE_STATE,
    MASTER_KEY,
    CheckpointCorrupted,
    CheckpointMismatch,
    Manifest,
    read_manifest,
    resolve_tag_dir,
)
from runtime.checkpoint.reshard import Copy, plan_copies, saved_shapes, source_index
from runtime.checkpoint.shards import (
    CopySource,
    ShardReader,
    load_optimizer_state,
    optimizer_params,
    shard_targets,
)

if TYPE_CHECKING:  # annotations only: the engine imports this package
    from runtime.engine import Engine

_log = logging.getLogger("runtime.checkpoint")


def open_checkpoint(load_dir: str | os.PathLike[str], tag: str | None) -> tuple[Path, Manifest]:
    tag_dir = resolve_tag_dir(load_dir, tag)
    return tag_dir, read_manifest(tag_dir)


def verify_files(tag_dir: Path, manifest: Manifest, rank: int = 0, world_size: int = 1) -> int:
    """Check size and CRC-32 of the manifest's files i with i % world_size == rank; returns bytes read."""
    checked = 0
    for i, entry in enumerate(manifest.files):
        if i % world_size != rank:
            continue
        path = tag_dir / entry.name
        if not path.is_file():
            raise CheckpointCorrupted(f"{path}: missing (the manifest of tag {manifest.tag!r} lists it)")
        size = path.stat().st_size
        if size != entry.size:
            raise CheckpointCorrupted(
                f"{path}: {size} bytes, but the manifest recorded {entry.size} (truncated or overwritten)"
            )
        _, crc = file_crc32(path)
        if crc != entry.crc32:
            raise CheckpointCorrupted(
                f"{path}: checksum mismatch (crc32 {crc:#010x}, manifest {entry.crc32:#010x}): the file is "
                "corrupted"
            )
        checked += size
    return checked


def read_engine_state(tag_dir: Path) -> dict[str, Any]:
    path = tag_dir / ENGINE_STATE
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise CheckpointCorrupted(f"{path}: missing") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointCorrupted(f"{path}: cannot be read safely ({first})") from None


def load_checkpoint(
    engine: Engine,
    load_dir: str | os.PathLike[str],
    tag: str | None = None,
    *,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str, dict[str, Any]]:
    """Load a checkpoint into `engine`; all ranks must call it. Returns (tag directory, client_state)."""
    comm = engine.comm
    root, tag = agree_on_location(
        comm, load_dir, tag, policy=engine.config.checkpoint.tag_validation, what="load_checkpoint"
    )
    tag_dir = agreed(comm, lambda: resolve_tag_dir(root, tag))
    new_reader: Callable[[], CopySource]
    if is_deepspeed_tag(tag_dir):  # DeepSpeed's files: read through the same plan (deepspeed_format)
        source = agreed(comm, lambda: open_deepspeed(tag_dir))
        manifest, new_reader = source.manifest, source.reader
        state = agreed(comm, lambda: source.engine_state(engine))
        if comm.rank == 0:
            version = source.tag.model_states.get("ds_version", "?")
            _log.info("%s was written by DeepSpeed %s", tag_dir, version)
    else:
        manifest = agreed(comm, lambda: read_manifest(tag_dir))
        agreed(comm, lambda: verify_files(tag_dir, manifest, comm.rank, comm.world_size))
        state = agreed(comm, lambda: read_engine_state(tag_dir))
        new_reader = lambda: ShardReader(tag_dir)  # noqa: E731
    with_optimizer = load_optimizer_states and not load_module_only and engine.optimizer is not None
    plans, extras, crossed = agreed(
        comm, lambda: _plan(engine, manifest, state, strict=load_module_strict, with_optimizer=with_optimizer)
    )
    agreed(comm, lambda: _fill(engine, new_reader(), manifest, state, plans, with_optimizer=with_optimizer))
    if crossed:
        _fill_crossed(engine, state["module_extras"], crossed)
    engine.zero.zero_grad()
    engine.zero.write_back()  # masters -> working weights, gathered across ranks

    def rest() -> None:
        engine_state.restore_module_extras(engine, state["module_extras"], extras)
        engine_state.restore(
            engine,
            state,
            saved_world=manifest.world_size,
            load_optimizer_states=with_optimizer,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )

    agreed(comm, rest)
    if comm.rank == 0:
        moved = (manifest.world_size, manifest.zero_stage) != (comm.world_size, engine.zero_stage)
        _log.info(
            "loaded checkpoint %s (saved by %d rank(s) at ZeRO stage %d%s)",
            tag_dir,
            manifest.world_size,
            manifest.zero_stage,
            f"; resharded for {comm.world_size} rank(s) at stage {engine.zero_stage}" if moved else "",
        )
    return str(tag_dir), dict(state.get("client_state") or {})


def _plan(
    engine: Engine, manifest: Manifest, state: dict[str, Any], *, strict: bool, with_optimizer: bool
) -> tuple[list[list[Copy]], list[str], frozenset[str]]:
    """Per flat group, the copies that fill this rank's shard, the module extras to load, and the grouped
    parameters filled from saved extras; every mismatch is raised here, before any tensor changes."""
    saved_extras = state["module_extras"]
    if with_optimizer and state.get("optimizer_param_groups"):
        engine_state.optimizer_group_options(engine, state["optimizer_param_groups"])
    shapes = saved_shapes(manifest)
    saved_group = {
        p.name: manifest.groups[g].optimizer_group
        for g, grp in enumerate(manifest.groups)
        for p in grp.params
    }
    # in the model's order, so that every message names the first parameter that differs
    order = {name: i for i, (name, _) in enumerate(engine.module.named_parameters())}
    ours = dict(
        sorted(
            (
                (name, (param, group))
                for group in engine.groups
                for name, param in zip(engine_state.param_names(engine, group), group.params, strict=True)
            ),
            key=lambda item: order.get(item[0], len(order)),
        )
    )
    # A parameter the checkpoint keeps whole among the module extras (a frozen one, saved by a training
    # engine) that this engine keeps in a flat group (a ZeRO-3 inference engine shards frozen ones too,
    # as Lightning's validate/test/predict builds it): filled from the extra (_fill_crossed)
    crossed = frozenset(name for name in ours if name not in shapes and name in saved_extras)
    extras = engine_state.check_module_extras(engine, saved_extras, strict=strict, in_groups=crossed)
    missing = [name for name in ours if name not in shapes and name not in crossed]
    unexpected = [name for name in shapes if name not in ours]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"trained parameters missing from the checkpoint: {_few(missing)}")
        if unexpected:
            parts.append(f"checkpoint parameters not in the model: {_few(unexpected)}")
        raise CheckpointMismatch("; ".join(parts) + " (load_module_strict=False skips them)")
    shapes = {**shapes, **{name: tuple(saved_extras[name].shape) for name in crossed}}
    differ = [
        name for name, (param, _) in ours.items() if name in shapes and tuple(param.shape) != shapes[name]
    ]
    if differ:
        name, more = differ[0], len(differ) - 1
        raise CheckpointMismatch(
            f"parameter {name!r}: shape {list(shapes[name])} in the checkpoint, "
            f"{list(ours[name][0].shape)} in the model" + (f" ({more} more differ)" if more else ""),
            hint="the checkpoint was saved from a model of other sizes: build the model with the sizes it "
            "was saved with",
        )
    for name, (_param, group) in ours.items():
        spec = engine_state.spec_index(group)
        if with_optimizer and name in saved_group and saved_group[name] != spec:
            raise CheckpointMismatch(
                f"parameter {name!r} was in optimizer param group {saved_group[name]} when saved and is in "
                f"group {spec} now; its optimizer state and hyperparameters would not match "
                "(load_optimizer_states=False loads the weights only)"
            )
    index = source_index(manifest)
    skip = set(missing) | crossed
    plans = [plan_copies(index, shard_targets(engine, group, skip=skip)) for group in engine.groups]
    return plans, extras, crossed


def _fill_crossed(engine: Engine, saved_extras: dict[str, Any], names: frozenset[str]) -> None:
    """This rank's shard elements of the grouped parameters `names` from their whole saved tensors."""
    with torch.no_grad():
        for group in engine.groups:
            master = group.master.data
            for target in shard_targets(engine, group):
                if target.name in names:
                    whole = saved_extras[target.name].reshape(-1)
                    piece = whole[target.param_offset : target.param_offset + target.numel]
                    master[target.dst_offset : target.dst_offset + target.numel].copy_(piece)


def _fill(
    engine: Engine,
    reader: CopySource,
    manifest: Manifest,
    state: dict[str, Any],
    plans: list[list[Copy]],
    *,
    with_optimizer: bool,
) -> None:
    """Fill every group's masters (and optimizer state) through `reader` (ShardReader, DeepSpeedReader)."""
    keys = manifest.optimizer_state_keys
    dtypes = {key: getattr(torch, name) for key, name in manifest.state_dtypes.items()}
    saved_scalars = state.get("optimizer_scalars") or []
    if with_optimizer and manifest.optimizer_class:
        current = f"{type(engine.optimizer).__module__}.{type(engine.optimizer).__qualname__}"
        if current != manifest.optimizer_class and engine.comm.rank == 0:
            _log.warning(
                "optimizer state saved by %s is loaded into %s (state keys: %s)",
                manifest.optimizer_class,
                current,
                ", ".join(keys) or "none",
            )
    _log_precision_change(engine, manifest, dtypes, with_optimizer)
    first_group = {p.name: g for g, grp in enumerate(manifest.groups) for p in grp.params}
    try:
        with torch.no_grad():
            for group, copies in zip(engine.groups, plans, strict=True):
                reader.fill(group.master.data, copies, MASTER_KEY)
                if not with_optimizer:
                    continue
                if not keys:  # saved before the first step: the optimizer starts fresh
                    for param in optimizer_params(engine, group):
                        engine.optimizer.state.pop(param, None)
                    continue
                names = engine_state.param_names(engine, group)
                source = first_group.get(names[0]) if names else None
                scalars = saved_scalars[source] if source is not None and source < len(saved_scalars) else {}
                # an optimizer whose groups keep different state (Muon's momentum, AdamW's moments) names them
                group_keys = getattr(engine.optimizer, "state_keys", None)
                own = keys if group_keys is None else [k for k in keys if k in group_keys(group.index)]
                load_optimizer_state(engine, group, reader, copies, own, dtypes, scalars)
    finally:
        reader.close()


def _log_precision_change(
    engine: Any, manifest: Manifest, dtypes: dict[str, torch.dtype], with_optimizer: bool
) -> None:
    """One line when the checkpoint's masters or moments are in another dtype than this run keeps
    (bf16.bf16_master_weights_and_grads / bf16_optimizer_states changed between save and load)."""
    if engine.comm.rank != 0 or not engine.groups:
        return
    changes = []
    master = str(engine.groups[0].master.dtype).removeprefix("torch.")
    if manifest.master_dtype != master:
        changes.append(f"master weights {manifest.master_dtype} -> {master}")
    state_dtype = getattr(engine.optimizer, "state_dtype", None)
    moments = ("exp_avg", "exp_avg_sq", "momentum_buffer")  # Adam's, and Muon's momentum
    saved = {str(d).removeprefix("torch.") for k, d in dtypes.items() if k in moments}
    now = str(state_dtype or engine.groups[0].master.dtype).removeprefix("torch.")
    if with_optimizer and saved and saved != {now}:
        changes.append(f"optimizer moments {'/'.join(sorted(saved))} -> {now}")
    if changes:
        _log.info("checkpoint: converting %s on load (bf16 section's 16-bit state keys)", ", ".join(changes))


def _few(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
