"""Pure index math for resharding: which bytes of which saved file fill which elements of a new shard.

The saved side is described by the manifest: per flat group, parameter offsets; per shard file, the
flat ranges its tensors hold. `source_index` turns that into, per parameter name, the sorted list of
element ranges and where they are stored. A destination (a rank's new master shard, laid out for any
world size, stage or grouping) is a list of `Target`s: "elements [a, a+n) of parameter P go to offset d".
`plan_copies` intersects the two and returns `Copy` operations, merged where both sides run on, and
refuses to leave an element unfilled. Nothing here touches tensors or files.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from runtime.checkpoint.manifest import CheckpointCorrupted, CheckpointMismatch, Manifest


@dataclass(frozen=True)
class Source:
    """Elements [start, end) of a parameter, stored at element `offset` of `file`'s group-`group` tensors."""

    start: int
    end: int
    file: str
    group: int
    offset: int


@dataclass(frozen=True)
class Target:
    """Elements [param_offset, param_offset + numel) of parameter `name` go to `dst_offset`."""

    name: str
    param_offset: int
    dst_offset: int
    numel: int


@dataclass(frozen=True)
class Copy:
    """Copy `numel` elements from `src_offset` of `file`'s group-`group` tensors to `dst_offset`."""

    file: str
    group: int
    src_offset: int
    dst_offset: int
    numel: int


def source_index(manifest: Manifest) -> dict[str, list[Source]]:
    """Per parameter name: the saved element ranges, sorted by start."""
    index: dict[str, list[Source]] = {p.name: [] for group in manifest.groups for p in group.params}
    for g, group in enumerate(manifest.groups):
        params = sorted(group.params, key=lambda p: p.offset)
        starts = [p.offset for p in params]
        for entry in manifest.shard_files():
            if g >= len(entry.ranges):
                raise CheckpointCorrupted(f"manifest: {entry.name} lists no ranges for group {g}")
            file_offset = 0
            for flat_start, flat_end in entry.ranges[g]:
                # the parameters overlapping [flat_start, flat_end)
                i = max(0, bisect.bisect_right(starts, flat_start) - 1)
                while i < len(params) and params[i].offset < flat_end:
                    p = params[i]
                    lo, hi = max(p.offset, flat_start), min(p.offset + p.numel, flat_end)
                    if lo < hi:
                        index[p.name].append(
                            Source(lo - p.offset, hi - p.offset, entry.name, g, file_offset + lo - flat_start)
                        )
                    i += 1
                file_offset += flat_end - flat_start
    for sources in index.values():
        sources.sort(key=lambda s: s.start)
    return index


def saved_shapes(manifest: Manifest) -> dict[str, tuple[int, ...]]:
    return {p.name: p.shape for group in manifest.groups for p in group.params}


def plan_copies(index: dict[str, list[Source]], targets: Iterable[Target]) -> list[Copy]:
    """The copies that fill every target from the saved sources; errors name the parameter and elements."""
    copies: list[Copy] = []
    starts: dict[str, list[int]] = {}
    for target in targets:
        sources = index.get(target.name)
        if sources is None:
            raise CheckpointMismatch(f"parameter {target.name!r} is not in the checkpoint")
        if target.name not in starts:
            starts[target.name] = [s.start for s in sources]
        want, end = target.param_offset, target.param_offset + target.numel
        i = max(0, bisect.bisect_right(starts[target.name], want) - 1)
        while want < end:
            if i >= len(sources) or sources[i].start > want or sources[i].end <= want:
                raise CheckpointCorrupted(
                    f"the checkpoint has no data for elements [{want}, {end}) of parameter {target.name!r} "
                    "(a shard file is missing from the manifest?)"
                )
            s = sources[i]
            n = min(end, s.end) - want
            copies.append(
                Copy(
                    s.file,
                    s.group,
                    s.offset + want - s.start,
                    target.dst_offset + want - target.param_offset,
                    n,
                )
            )
            want += n
            i += 1
    return merge_copies(copies)


def merge_copies(copies: Sequence[Copy]) -> list[Copy]:
    """Join copies that continue each other on both sides (fewer, larger reads)."""
    out: list[Copy] = []
    for c in sorted(copies, key=lambda c: (c.file, c.group, c.src_offset)):
        last = out[-1] if out else None
        if (
            last is not None
            and last.file == c.file
            and last.group == c.group
            and last.src_offset + last.numel == c.src_offset
            and last.dst_offset + last.numel == c.dst_offset
        ):
            out[-1] = Copy(last.file, last.group, last.src_offset, last.dst_offset, last.numel + c.numel)
        else:
            out.append(c)
    return out
