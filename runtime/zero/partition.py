"""Pure index math for flat buffers: where each parameter sits, how buckets split, which slice a rank owns.

A param group is flattened into one 1-D buffer. Parameters are laid out in the order given (the engine
passes reverse registration order, so buckets fill in the order backward produces gradients), each
starting at a multiple of `align` elements so every view is suitably aligned for vectorized kernels.
Consecutive parameters form buckets of about `bucket_numel` elements; a parameter never straddles two
buckets. Each bucket is padded to a multiple of `align * world_size`, and rank r owns the r-th of
`world_size` equal pieces of *every* bucket. Because the pieces are equal, a bucket's gradients can be
reduce-scattered and its parameters all-gathered with one collective each, as soon as the bucket is
complete, while backward is still running.

Words: a *piece* is one rank's slice of one bucket; a rank's *shard* is the concatenation of its pieces
(bucket order), held as one contiguous tensor (fp32 master weights, optimizer state, stage-2 gradients).
Nothing here touches tensors, so stage 3 and checkpoint resharding can reuse it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ALIGN_ELEMENTS = 64
"""Default start alignment (elements) of every parameter and piece: 128 bytes in bf16, 256 in fp32."""


def align_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def intersect(a_start: int, a_end: int, b_start: int, b_end: int) -> tuple[int, int] | None:
    """The overlap [start, end) of two half-open ranges, or None when they do not overlap."""
    start, end = max(a_start, b_start), min(a_end, b_end)
    return (start, end) if start < end else None


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the flat buffer."""

    offset: int  # flat index of the parameter's first element
    numel: int
    bucket: int  # index of the bucket that holds it


@dataclass(frozen=True)
class Bucket:
    """A contiguous, padded range of the flat buffer that is communicated with one collective."""

    index: int
    start: int  # flat index of the first element
    numel: int  # padded size, a multiple of world_size * align
    params: tuple[int, ...]  # indices of the parameters inside, in layout order
    shard_offset: int  # where this bucket's piece starts inside every rank's shard
    world_size: int

    @property
    def end(self) -> int:
        return self.start + self.numel

    @property
    def piece_numel(self) -> int:
        return self.numel // self.world_size

    def piece(self, rank: int) -> tuple[int, int]:
        """Flat [start, end) of `rank`'s piece of this bucket."""
        start = self.start + rank * self.piece_numel
        return start, start + self.piece_numel


@dataclass(frozen=True)
class ParamPiece:
    """The part of one parameter that falls into one rank's shard."""

    param: int  # parameter index
    param_offset: int  # first element, counted inside the parameter (flattened)
    shard_offset: int  # first element, counted inside the rank's shard
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    """The plan of one flat buffer: parameter slots, buckets and shards for `world_size` ranks."""

    slots: tuple[ParamSlot, ...]  # indexed like the `numels` the layout was planned from
    buckets: tuple[Bucket, ...]
    numel: int  # total padded size of the flat buffer
    world_size: int
    align: int

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world_size

    @property
    def shard_is_contiguous(self) -> bool:
        """True when a rank's shard is one contiguous range of the flat buffer (so it can be a view)."""
        return self.world_size == 1 or len(self.buckets) <= 1

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Flat [start, end) of `rank`'s shard; only valid when `shard_is_contiguous`."""
        if not self.shard_is_contiguous:
            raise ValueError(
                "the shard is not contiguous in the flat buffer (several buckets, world_size > 1)"
            )
        if not self.buckets:
            return 0, 0
        return self.buckets[0].piece(rank) if self.world_size > 1 else (0, self.numel)

    def param_pieces(self, rank: int) -> list[ParamPiece]:
        """Every part of every parameter that lands in `rank`'s shard, in shard order."""
        out: list[ParamPiece] = []
        for bucket in self.buckets:
            p_start, p_end = bucket.piece(rank)
            for index in bucket.params:
                slot = self.slots[index]
                hit = intersect(slot.offset, slot.offset + slot.numel, p_start, p_end)
                if hit is not None:
                    out.append(
                        ParamPiece(
                            param=index,
                            param_offset=hit[0] - slot.offset,
                            shard_offset=bucket.shard_offset + hit[0] - p_start,
                            numel=hit[1] - hit[0],
                        )
                    )
        return out

    def owner_of(self, flat_index: int) -> tuple[int, int]:
        """(rank, shard index) holding flat element `flat_index`."""
        for bucket in self.buckets:
            if bucket.start <= flat_index < bucket.end:
                rank, within = divmod(flat_index - bucket.start, bucket.piece_numel)
                return rank, bucket.shard_offset + within
        raise IndexError(f"flat index {flat_index} is outside the layout (numel {self.numel})")


def plan_flat_layout(
    numels: Sequence[int], *, world_size: int, bucket_numel: int, align: int = ALIGN_ELEMENTS
) -> FlatLayout:
    """Lay out parameters of the given sizes, in the given order, into buckets and shards.

    Args:
        numels: element count of each parameter, in layout order.
        world_size: number of ranks that split every bucket (1 = no sharding).
        bucket_numel: a bucket closes before the parameter that would take it past this size; a parameter
            larger than this gets a bucket of its own.
        align: every parameter and every piece starts at a multiple of this many elements.

    Returns:
        The layout; `layout.slots[i]` belongs to `numels[i]`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if any(n < 0 for n in numels):
        raise ValueError(f"parameter sizes must be >= 0, got {list(numels)}")

    slots: list[ParamSlot] = []
    buckets: list[Bucket] = []
    pad_to = align * world_size
    members: list[int] = []
    start = cursor = shard_offset = 0

    def close_bucket() -> None:
        nonlocal start, cursor, shard_offset, members
        size = align_up(max(cursor - start, 1), pad_to)
        buckets.append(Bucket(len(buckets), start, size, tuple(members), shard_offset, world_size))
        shard_offset += size // world_size
        start = cursor = start + size
        members = []

    for index, numel in enumerate(numels):
        offset = align_up(cursor, align)
        if members and offset + numel - start > bucket_numel:
            close_bucket()
            offset = cursor
        slots.append(ParamSlot(offset, numel, len(buckets)))
        members.append(index)
        cursor = offset + numel
    if members:
        close_bucket()
    return FlatLayout(tuple(slots), tuple(buckets), start, world_size, align)
