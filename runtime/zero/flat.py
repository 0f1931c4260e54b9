"""One optimizer param group as flat buffers: working weights for the model, a master shard for the optimizer.

`flatten_group` moves every parameter of a group into one 1-D working buffer in `param_dtype` (the module's
parameters become views into it, so an all-gather into the buffer updates the model with no copy) and
builds this rank's master shard in `master_dtype` from the parameters' original values (so fp32 master
weights keep full precision even when the working copy is bf16). When both dtypes agree and the shard is
one contiguous range of the buffer, the master *is* that range and no copy exists.

Owns: the layout of a group, the working buffer, the master shard. Does not own gradients or collectives
(the ZeRO stages do).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from runtime.zero.partition import ALIGN_ELEMENTS, Bucket, FlatLayout, plan_flat_layout


@dataclass
class FlatGroup:
    """A flattened param group: `params[i]` is a view of `working` at `layout.slots[i]`."""

    index: int
    params: list[nn.Parameter]  # layout order
    options: dict[str, Any]  # the param group's options (lr, weight_decay, ...), without "params"
    layout: FlatLayout
    rank: int  # the rank whose shard `master` holds (0 when not sharded)
    working: torch.Tensor  # 1-D, param_dtype, layout.numel elements
    master: nn.Parameter  # 1-D, master dtype, layout.shard_numel elements; what the optimizer steps
    master_is_alias: bool = False  # master shares memory with `working` (stage 3: with its shard)
    # this rank's pieces of `working` already hold the updated master (the fused step casts as it updates);
    # the next copy_master_to_working skips its copy and clears it
    working_written: bool = False
    param_names: list[str] = field(default_factory=list)
    spec_index: int = -1  # the param group (GroupSpec) it came from; -1: the same as `index`
    # the dtype its gradients are reduced in when it is not the stage's (GroupSpec.reduce_dtype)
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.spec_index < 0:
            self.spec_index = self.index

    def piece(self, buffer: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """This rank's piece of `bucket` in a flat buffer laid out like `working`."""
        start, end = bucket.piece(self.rank)
        return buffer[start:end]

    def bucket_view(self, buffer: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return buffer[bucket.start : bucket.end]

    def master_piece(self, bucket: Bucket) -> torch.Tensor:
        """The part of the master shard that belongs to `bucket`."""
        return self.master.data.narrow(0, bucket.shard_offset, bucket.piece_numel)

    def copy_master_to_working(self) -> None:
        """Write the updated master shard into this rank's pieces of the working buffer (cast)."""
        if self.master_is_alias:
            return
        if self.working_written:  # the step wrote them already (precision/fused_master.py)
            self.working_written = False
            return
        if self.layout.shard_is_contiguous:
            start, end = self.layout.shard_range(self.rank)
            self.working[start:end].copy_(self.master.data)
            return
        for bucket in self.layout.buckets:
            self.piece(self.working, bucket).copy_(self.master_piece(bucket))

    @property
    def param_numel(self) -> int:
        return sum(slot.numel for slot in self.layout.slots)


def flatten_group(
    index: int,
    params: Sequence[nn.Parameter],
    options: dict[str, Any],
    *,
    world_size: int,
    rank: int,
    bucket_numel: int,
    param_dtype: torch.dtype,
    master_dtype: torch.dtype,
    device: torch.device,
    align: int = ALIGN_ELEMENTS,
    names: Sequence[str] = (),
) -> FlatGroup:
    """Flatten `params` (already in layout order, on `device`) into a `FlatGroup`.

    Args:
        index: the group's position among the optimizer's param groups.
        params: the group's parameters, in the order they should be laid out.
        options: the group's hyperparameters (everything but "params").
        world_size, rank: how the master shard is split and which piece this process keeps.
        bucket_numel: target bucket size in elements (one collective per bucket).
        param_dtype: dtype of the working buffer (and of the module's parameters afterwards).
        master_dtype: dtype of the master shard.
        device: where both buffers live.
    """
    layout = plan_flat_layout(
        [p.numel() for p in params], world_size=world_size, bucket_numel=bucket_numel, align=align
    )
    with torch.no_grad():
        working = torch.zeros(layout.numel, dtype=param_dtype, device=device)
        alias = master_dtype == param_dtype and layout.shard_is_contiguous
        master_data = None if alias else torch.zeros(layout.shard_numel, dtype=master_dtype, device=device)
        # The master comes from the original values, before the working copy rounds them.
        if master_data is not None:
            for piece in layout.param_pieces(rank):
                source = params[piece.param].detach().reshape(-1)
                master_data.narrow(0, piece.shard_offset, piece.numel).copy_(
                    source.narrow(0, piece.param_offset, piece.numel)
                )
        for param, slot in zip(params, layout.slots, strict=True):
            view = working.narrow(0, slot.offset, slot.numel)
            view.copy_(param.detach().reshape(-1))
            param.data = view.view(param.shape)
        if alias:
            start, end = layout.shard_range(rank)
            master_data = working[start:end]
    assert master_data is not None  # the working buffer's shard when it aliases
    master = nn.Parameter(master_data, requires_grad=True)
    return FlatGroup(
        index=index,
        params=list(params),
        options=dict(options),
        layout=layout,
        rank=rank,
        working=working,
        master=master,
        master_is_alias=alias,
        param_names=list(names),
    )
