"""Muon under ZeRO 1-3: whole matrices for the Newton-Schulz orthogonalization, from element-range shards.

ZeRO splits every bucket of a flat group into equal element ranges, one per rank, so a matrix is usually
spread over several ranks' shards. Muon's momentum, decay and update are elementwise and stay sharded
(its one state buffer is split like Adam's); only the orthogonalized matrix O needs the whole matrix.

How: each Muon matrix of a group has one owner rank, chosen greedily by Newton-Schulz cost (numel x
the smaller side) so every rank gets about the same work. At the step, per bucket (a parameter never
straddles buckets; a ZeRO-3 segment is one bucket): all-gather the ranks' pieces of the momentum update
into the whole bucket, the owners orthogonalize their matrices into a zeroed bucket-sized buffer, and one
reduce-scatter (sum; every non-owner adds exact zeros) hands each rank O for its own elements.

Cost per step, per Muon parameter: one all-gather and one reduce-scatter of the master dtype (as much
traffic again as the gradient reduce-scatter plus the weight all-gather of an fp32 step); two transient
bucket-sized buffers; Newton-Schulz work split over the ranks instead of repeated on each.
Nothing is kept between steps, so checkpoints hold the same state as without sharding (the momentum
shard), and resuming needs nothing from here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from runtime.comm import Comm
from runtime.zero.flat import FlatGroup

NewtonSchulz = Callable[[torch.Tensor], torch.Tensor]
UpdatePiece = tuple[int, int, torch.Tensor, torch.Size]


def assign_owners(shapes: Sequence[torch.Size], world_size: int) -> list[int]:
    """Pure: an owner rank per matrix, the largest first onto the least-loaded rank (ties: lowest rank)."""
    load = [0] * world_size
    owners = [0] * len(shapes)
    order = sorted(range(len(shapes)), key=lambda i: (-_cost(shapes[i]), i))
    for index in order:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += _cost(shapes[index])
    return owners


def _cost(shape: torch.Size) -> int:
    return shape[0] * shape[1] * min(shape[0], shape[1])


class ShardOrthogonalizer:
    """O for the matrices of one flat Muon group, on this rank's shard (module docstring)."""

    def __init__(self, group: FlatGroup, comm: Comm) -> None:
        self.group = group
        self.comm = comm
        self.shapes = [p.shape for p in group.params]
        self.owners = assign_owners(self.shapes, comm.world_size)

    def __call__(self, update: torch.Tensor, newton_schulz: NewtonSchulz) -> list[UpdatePiece]:
        layout, rank = self.group.layout, self.comm.rank
        pieces: list[UpdatePiece] = []
        by_bucket: dict[int, list[tuple[int, int, int]]] = {}
        for piece in layout.param_pieces(rank):
            holder = layout.slots[piece.param].bucket
            by_bucket.setdefault(holder, []).append((piece.param, piece.param_offset, piece.numel))
        # under offload_optimizer the update is on the host: the collectives and Newton-Schulz run on the
        # training device, where the working weights are (NCCL takes no host tensors)
        device = self.group.working.device
        for bucket in layout.buckets:
            mine = update.narrow(0, bucket.shard_offset, bucket.piece_numel).to(device)
            whole = torch.empty(bucket.numel, dtype=update.dtype, device=device)
            self.comm.all_gather(whole, mine)
            ortho = torch.zeros_like(whole)
            for index in bucket.params:
                if self.owners[index] != rank:
                    continue
                slot = layout.slots[index]
                start = slot.offset - bucket.start
                matrix = whole.narrow(0, start, slot.numel).view(self.shapes[index])
                ortho.narrow(0, start, slot.numel).copy_(newton_schulz(matrix).reshape(-1))
            own = torch.empty_like(mine)
            self.comm.reduce_scatter(own, ortho)
            for index, param_offset, numel in by_bucket.get(bucket.index, []):
                slot = layout.slots[index]
                within = slot.offset + param_offset - bucket.piece(rank)[0]
                pieces.append(
                    (
                        bucket.shard_offset + within,
                        numel,
                        own.narrow(0, within, numel).to(update.device),
                        self.shapes[index],
                    )
                )
        return pieces


def install_orthogonalizers(
    optimizer: torch.optim.Optimizer, groups: Sequence[FlatGroup], comm: Comm
) -> None:
    """Give a Muon optimizer (runtime.optim.muon) the sharded O of each of its flat Muon groups."""
    table = getattr(optimizer, "orthogonalizers", None)
    if table is None:
        return
    for group in groups:
        if optimizer.param_groups[group.index].get("use_muon"):
            table[group.index] = ShardOrthogonalizer(group, comm)
