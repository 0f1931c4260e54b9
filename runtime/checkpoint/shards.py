"""The engine's flat groups on disk: which flat ranges a rank writes, and filling a new shard from files.

Saving: a rank writes, per flat group, its master shard and every optimizer state tensor shaped like it,
as the flat ranges `saved_pieces` lists. With sharded state (stages 1/2) those are the rank's bucket
pieces; with replicated state (stage 0, or one rank) every rank holds everything, so rank r writes the
r-th of W contiguous slices and the save is still spread over all ranks. Per-tensor optimizers (stage 0
only) keep one state tensor per parameter; they are written into the same flat order.

Loading: the rank's new layout gives `Target`s (parameter element ranges -> shard offsets), reshard.py
plans the copies, and `ShardReader` performs them with positioned reads, for the master and for each
optimizer state key, so a rank reads only the bytes its new shard needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from runtime.checkpoint.engine_state import param_names
from runtime.checkpoint.manifest import CheckpointCorrupted, CheckpointMismatch, tensor_name
from runtime.checkpoint.reshard import Copy, Target
from runtime.checkpoint.tensorfile import TensorFileError, TensorFileReader

if TYPE_CHECKING:  # annotations only: the engine imports this package
    from runtime.engine import Engine


@dataclass(frozen=True)
class Piece:
    """Flat range [flat_start, flat_end) of a group, stored at `shard_offset` of this rank's tensors."""

    flat_start: int
    flat_end: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.flat_end - self.flat_start


def split_range(numel: int, parts: int, index: int) -> tuple[int, int]:
    """The `index`-th of `parts` near-equal contiguous slices of [0, numel)."""
    return numel * index // parts, numel * (index + 1) // parts


def saved_pieces(layout: Any, group_rank: int, world_size: int, rank: int) -> list[Piece]:
    """The flat ranges rank `rank` of `world_size` writes for a group laid out by `layout`."""
    pieces = []
    for bucket in layout.buckets:
        start, end = bucket.piece(group_rank)
        pieces.append(Piece(start, end, bucket.shard_offset))
    if layout.world_size == 1 and world_size > 1:  # replicated: spread the writing over all ranks
        lo, hi = split_range(layout.numel, world_size, rank)
        cut = []
        for p in pieces:
            a, b = max(p.flat_start, lo), min(p.flat_end, hi)
            if a < b:
                cut.append(Piece(a, b, p.shard_offset + a - p.flat_start))
        pieces = cut
    merged: list[Piece] = []
    for p in pieces:
        last = merged[-1] if merged else None
        if last and last.flat_end == p.flat_start and last.shard_offset + last.numel == p.shard_offset:
            merged[-1] = Piece(last.flat_start, p.flat_end, last.shard_offset)
        else:
            merged.append(p)
    return merged


# -- optimizer state as flat tensors ----------------------------------------------------------------------
def optimizer_params(engine: Engine, group: Any) -> list[torch.Tensor]:
    """The tensors the optimizer steps for this flat group: [master] or one view per parameter."""
    if engine.optimizer is None:
        return []
    return list(engine.optimizer.param_groups[group.index]["params"])


def _is_flat(params: Sequence[torch.Tensor], group: Any) -> bool:
    return len(params) == 1 and params[0] is group.master


def optimizer_state(engine: Engine, group: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state tensors shaped like the master shard, scalar state) of one flat group."""
    params = optimizer_params(engine, group)
    if not params:
        return {}, {}
    state = engine.optimizer.state
    master = group.master
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    flat = _is_flat(params, group)
    for i, param in enumerate(params):
        for key, value in state.get(param, {}).items():
            if not torch.is_tensor(value) or (value.numel() == 1 and value.shape != param.shape):
                if key not in scalars:
                    scalars[key] = _scalar(value, param)
                continue
            if value.shape != param.shape:
                raise CheckpointMismatch(
                    f"optimizer state {key!r} of {type(engine.optimizer).__name__} has shape "
                    f"{tuple(value.shape)}, not its parameter's {tuple(param.shape)}: it cannot be sharded"
                )
            if flat:
                tensors[key] = value
                continue
            if key not in tensors:
                tensors[key] = torch.zeros(master.numel(), dtype=value.dtype, device=value.device)
            slot = group.layout.slots[i]
            tensors[key].narrow(0, slot.offset, slot.numel).copy_(value.reshape(-1))
    return tensors, scalars


def _scalar(value: Any, param: torch.Tensor) -> dict[str, Any]:
    if torch.is_tensor(value):
        return {"value": value.detach().cpu().clone(), "on_param_device": value.device == param.device}
    return {"value": value, "on_param_device": False}


def _scalar_value(saved: dict[str, Any], param: torch.Tensor) -> Any:
    value = saved["value"]
    if torch.is_tensor(value):
        return value.clone().to(param.device if saved["on_param_device"] else "cpu")
    return value


# -- loading ----------------------------------------------------------------------------------------------
class CopySource(Protocol):
    """What a load fills new shards through: `ShardReader` (our files) or
    `deepspeed_format.DeepSpeedReader` (DeepSpeed's per-rank tensors)."""

    bytes_read: int

    def fill(self, dst: torch.Tensor, copies: Sequence[Copy], key: str) -> None:
        """Run `copies` of state `key` into the 1-D tensor `dst`."""

    def close(self) -> None:
        """Release what the reads held open."""


class ShardReader:
    """Open shard files of one tag lazily and perform copies from them."""

    def __init__(self, tag_dir: Path) -> None:
        self.tag_dir = tag_dir
        self._readers: dict[str, TensorFileReader] = {}
        self.bytes_read = 0

    def reader(self, file: str) -> TensorFileReader:
        if file not in self._readers:
            try:
                self._readers[file] = TensorFileReader(self.tag_dir / file)
            except TensorFileError as error:
                raise CheckpointCorrupted(str(error)) from None
        return self._readers[file]

    def fill(self, dst: torch.Tensor, copies: Sequence[Copy], key: str) -> None:
        """Run `copies` of state `key` into the 1-D tensor `dst` (any device or dtype)."""
        for c in copies:
            reader = self.reader(c.file)
            name = tensor_name(c.group, key)
            try:
                out = dst.narrow(0, c.dst_offset, c.numel)
                stored = reader.spec(name).dtype
                if out.device.type == "cpu" and out.dtype == stored:
                    reader.read_into(name, out, c.src_offset)
                else:
                    out.copy_(reader.read(name, c.src_offset, c.numel))
            except TensorFileError as error:
                raise CheckpointCorrupted(str(error)) from None
            self.bytes_read += c.numel * dst.element_size()

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()


def shard_targets(engine: Engine, group: Any, *, skip: AbstractSet[str] = frozenset()) -> list[Target]:
    """Where each parameter element of this rank's shard of `group` goes (names in `skip` left out)."""
    names = param_names(engine, group)
    return [
        Target(names[p.param], p.param_offset, p.shard_offset, p.numel)
        for p in group.layout.param_pieces(group.rank)
        if names[p.param] not in skip
    ]


def load_optimizer_state(
    engine: Engine,
    group: Any,
    reader: CopySource,
    copies: Sequence[Copy],
    keys: Sequence[str],
    dtypes: dict[str, torch.dtype],
    scalars: dict[str, Any],
) -> None:
    """Fill the optimizer state of one flat group from the checkpoint: into the tensors the engine made at
    setup where they fit (their layout kept, no second copy held), else into new ones."""
    params = optimizer_params(engine, group)
    if not params:
        return
    state = engine.optimizer.state
    master = group.master
    flat = _is_flat(params, group)
    for key in keys:
        current = state.get(master, {}).get(key) if flat else None
        if current is not None and current.shape == master.shape:
            dst = current
        else:
            # floating-point state in the dtype this run keeps it in (torch's optimizers: the masters';
            # precision.MasterAdam: its state_dtype), whatever the saving run kept: bf16 <-> fp32 states
            dtype = dtypes[key]
            if dtype.is_floating_point:
                dtype = getattr(engine.optimizer, "state_dtype", None) or master.dtype
            dst = torch.zeros(master.numel(), dtype=dtype, device=master.device)
        reader.fill(dst, copies, key)
        if flat:
            state.setdefault(master, {})[key] = dst
            continue
        for param, slot in zip(params, group.layout.slots, strict=True):
            piece = dst.narrow(0, slot.offset, slot.numel).view(param.shape)
            held = state.get(param, {}).get(key)
            if held is not None and (held.shape, held.dtype, held.device) == (
                param.shape,
                dst.dtype,
                dst.device,
            ):
                held.copy_(piece)  # the state the engine made at setup: filled where it is, no second copy
            else:
                state.setdefault(param, {})[key] = piece.clone()
    for key, saved in scalars.items():
        for param in params:
            state.setdefault(param, {})[key] = _scalar_value(saved, param)
