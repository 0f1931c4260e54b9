"""DeepSpeed's ZeRO checkpoint layout as pure index math: which flat ranges each rank's tensors hold.

ZeRO 1/2 lay a param group's parameters back to back in one flat buffer, padded at its end, and cut it into
one equal contiguous partition per rank (`partitioned_layout`). ZeRO 3 pads every parameter to a multiple of
the world size and gives rank r piece r of each, parameter after parameter (`per_param_layout`). Both come
out as `FlatGroup`s: parameters at flat offsets, and per rank the flat ranges its tensor holds, in order,
the same description runtime.checkpoint.reshard works with. No files, no tensors (stdlib only: it is part of
the standalone zero_to_fp32.py, see recovery_script).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FlatParam:
    name: str
    shape: tuple[int, ...]
    offset: int  # first element in the group's flat coordinates

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class FlatGroup:
    """One optimizer param group in flat coordinates; `ranges[r]` lists the flat ranges rank r's tensors
    hold, in order, and `start[r]` where they begin in rank r's concatenated tensor (stage 3)."""

    params: tuple[FlatParam, ...]
    numel: int
    ranges: tuple[tuple[tuple[int, int], ...], ...]
    start: tuple[int, ...]


def numel_of(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def partitioned_layout(
    param_shapes: Sequence[Mapping[str, tuple[int, ...]]], partition_sizes: Sequence[int], world: int
) -> list[FlatGroup]:
    """ZeRO 1/2: a group's parameters back to back, the padded buffer cut into `world` equal partitions."""
    groups = []
    for shapes, size in zip(param_shapes, partition_sizes, strict=True):
        params, offset = [], 0
        for name, shape in shapes.items():
            params.append(FlatParam(name, tuple(shape), offset))
            offset += numel_of(tuple(shape))
        if size * world < offset:
            raise ValueError(f"partitions of {size} elements on {world} ranks cannot hold {offset} elements")
        ranges = tuple(((r * size, (r + 1) * size),) for r in range(world))
        groups.append(FlatGroup(tuple(params), size * world, ranges, (0,) * world))
    return groups


def per_param_layout(param_shapes: Sequence[Mapping[str, tuple[int, ...]]], world: int) -> list[FlatGroup]:
    """ZeRO 3: every parameter padded to a multiple of `world` and cut into equal pieces; rank r holds
    piece r of each, parameter after parameter, group after group."""
    groups, begin = [], 0
    for shapes in param_shapes:
        params, offset = [], 0
        ranges: list[list[tuple[int, int]]] = [[] for _ in range(world)]
        for name, shape in shapes.items():
            numel = numel_of(tuple(shape))
            piece = -(-numel // world)
            params.append(FlatParam(name, tuple(shape), offset))
            for r in range(world):
                ranges[r].append((offset + r * piece, offset + (r + 1) * piece))
            offset += piece * world
        groups.append(FlatGroup(tuple(params), offset, tuple(tuple(x) for x in ranges), (begin,) * world))
        begin += offset // world
    return groups


def param_pieces(group: FlatGroup, rank: int) -> list[tuple[FlatParam, int, int, int]]:
    """(parameter, its first element, count, position in rank `rank`'s tensor) for what the rank holds."""
    out, position = [], 0
    for lo, hi in group.ranges[rank]:
        for p in group.params:
            a, b = max(lo, p.offset), min(hi, p.offset + p.numel)
            if a < b:
                out.append((p, a - p.offset, b - a, position + a - lo))
        position += hi - lo
    return out
