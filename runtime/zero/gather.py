"""Reassembling full parameters from master shards (for full state dicts and checks).

Every rank all-gathers each group's master shard; the shards are then put back into flat-buffer order
bucket by bucket (rank r's piece of bucket b sits at `b.shard_offset` inside shard r) and cut into
parameters. Costs one all-gather per group; ranks that do not keep the result hold one group at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.comm import Comm
from runtime.zero.flat import FlatGroup


def gather_flat_master(group: FlatGroup, comm: Comm) -> torch.Tensor:
    """The group's full master buffer in flat-layout order (a fresh tensor)."""
    master = group.master.detach()
    return master.clone() if group.layout.world_size == 1 else gather_flat(group, comm, master)


def gather_flat(group: FlatGroup, comm: Comm, shard: torch.Tensor) -> torch.Tensor:
    """Any per-rank shard of `group` (its master, an optimizer state) whole, in flat-layout order."""
    layout = group.layout
    shards = torch.empty(layout.world_size * layout.shard_numel, dtype=shard.dtype, device=shard.device)
    comm.all_gather(shards, shard.contiguous())
    flat = torch.empty(layout.numel, dtype=shard.dtype, device=shard.device)
    for bucket in layout.buckets:
        for rank in range(layout.world_size):
            start, end = bucket.piece(rank)
            source = rank * layout.shard_numel + bucket.shard_offset
            flat[start:end].copy_(shards[source : source + bucket.piece_numel])
    return flat


def gather_master_params(
    groups: Sequence[FlatGroup], comm: Comm, *, keep: bool = True
) -> list[list[torch.Tensor]]:
    """Per group, one full master tensor per parameter (shaped like the parameter). Every rank takes part;
    with keep=False this rank drops each group right after its gather and gets empty lists, so it never
    holds more than one whole group (ZeRO-3 saves on rank 0 without a full model on the others)."""
    out: list[list[torch.Tensor]] = []
    for group in groups:
        flat = gather_flat_master(group, comm)
        if not keep:
            out.append([])
            continue
        out.append(
            [
                flat.narrow(0, slot.offset, slot.numel).view(param.shape)
                for param, slot in zip(group.params, group.layout.slots, strict=True)
            ]
        )
    return out
