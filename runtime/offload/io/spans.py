"""Pure index math of the offload step: which slices of a master shard move and update together.

A *span* is this rank's piece of one bucket: the unit that lands on the host (one device-to-host copy,
as soon as the bucket's reduced gradient is final) and the unit the step updates in landing order.
When the GPU and the CPU share the step, the GPU updates each span's head and the CPU its tail
(`share_span`). Spans are split into *chunks* of at most `chunk_elems` elements: the host updates
chunk i while chunk i-1 is copied back to the device, so the copy-back hides under the update except
for the last chunk.

Nothing here touches tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from runtime.zero.partition import FlatLayout, align_up

CHUNK_ALIGN = 64  # elements: chunk boundaries on whole cache lines, and aligned starts for vector kernels


@dataclass(frozen=True)
class Span:
    """This rank's piece of bucket `bucket` of group `group`, at `shard_offset` inside the group's shard."""

    group: int
    bucket: int
    shard_offset: int
    numel: int


def plan_spans(layouts: Sequence[FlatLayout], order: Sequence[tuple[int, int]]) -> list[Span]:
    """One span per (group, bucket) in `order` (the order their gradients become final)."""
    spans = []
    for g, b in order:
        bucket = layouts[g].buckets[b]
        spans.append(Span(g, b, bucket.shard_offset, bucket.piece_numel))
    covered = sorted(set(order))
    expected = [(g, b.index) for g, layout in enumerate(layouts) for b in layout.buckets]
    if covered != expected or len(order) != len(expected):
        raise ValueError(f"order must name every (group, bucket) once; got {list(order)}, need {expected}")
    return spans


def share_span(span: Span, share: float) -> tuple[Span, Span]:
    """Split `span` between the GPU (its head) and the CPU (its tail, about `share` of its elements, from 0
    to 1), at a whole cache line: both update every span at the same time, the GPU its head streamed
    through the device while the CPU updates the tail from landed gradients. Either part may be empty."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be between 0 and 1, got {share}")
    head = min(span.numel, align_up(round(span.numel * (1.0 - share)), CHUNK_ALIGN)) if share < 1.0 else 0
    return (
        Span(span.group, span.bucket, span.shard_offset, head),
        Span(span.group, span.bucket, span.shard_offset + head, span.numel - head),
    )


def packed_offsets(parts: Sequence[Span], groups: int) -> tuple[list[int], list[int]]:
    """Where each part starts in a buffer per group that holds only these parts, packed in shard order,
    and each group's buffer length."""
    offsets, lengths = [0] * len(parts), [0] * groups
    for index in sorted(range(len(parts)), key=lambda i: (parts[i].group, parts[i].shard_offset)):
        part = parts[index]
        offsets[index] = lengths[part.group]
        lengths[part.group] += part.numel
    return offsets, lengths


def plan_chunks(numel: int, chunk_elems: int) -> list[tuple[int, int]]:
    """(offset, numel) pieces covering [0, numel), each at most `chunk_elems` (rounded up to CHUNK_ALIGN)
    elements long; 0 means one piece."""
    if chunk_elems < 0:
        raise ValueError(f"chunk_elems must be >= 0 (0 = one chunk), got {chunk_elems}")
    if numel <= 0:
        return []
    step = numel if chunk_elems == 0 else align_up(chunk_elems, CHUNK_ALIGN)
    return [(start, min(step, numel - start)) for start in range(0, numel, step)]


def piece_containing(sizes: Sequence[int], offset: int, numel: int) -> tuple[int, int]:
    """(index, offset inside it) of the piece that holds [offset, offset + numel), where consecutive
    pieces of the given sizes tile a shard. Raises when the range straddles two pieces."""
    start = 0
    for index, size in enumerate(sizes):
        if offset < start + size:
            if offset + numel > start + size:
                break
            return index, offset - start
        start += size
    raise ValueError(f"range [{offset}, {offset + numel}) is not inside one piece of sizes {list(sizes)}")
