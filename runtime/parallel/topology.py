"""Rank arithmetic of a multi-axis process grid, with DeepSpeed's topology classes and method names.

A `ProcessTopology` maps each global rank to a coordinate on named axes (row-major: the last axis varies
fastest), which is the same layout `torch.distributed.device_mesh.init_device_mesh` gives a mesh of the
same dims. Pure: no process groups here (`runtime.parallel.grid` builds those from a topology).

Words: an axis is a named grid dimension ("pipe", "data", "model"); its dim is how many ranks lie along it.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from collections.abc import Callable, Sequence
from typing import Any

from runtime.config.parallel import TopologyError, check_grid_degrees

PIPE, DATA, MODEL = "pipe", "data", "model"


class ProcessTopology:
    """Global ranks laid out over named axes, row-major (the last axis varies fastest)."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims):
            raise TopologyError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}")
        if len(set(axes)) != len(axes):
            raise TopologyError(f"ProcessTopology: axis names must be unique, got {axes}")
        if any(d < 1 for d in dims):
            raise TopologyError(
                f"ProcessTopology: every dim must be at least 1, got {dict(zip(axes, dims, strict=True))}"
            )
        self.axes = axes
        self.dims = dims
        # DeepSpeed's coordinate class, one field per axis; built through a plain callable because mypy
        # types namedtuple() only for field names written in the source, and these are the caller's
        make_coord: Callable[..., Callable[..., tuple[int, ...]]] = namedtuple
        self.ProcessCoord = make_coord("ProcessCoord", axes)
        self._coord_of = [self.ProcessCoord(*coord) for coord in itertools.product(*(range(d) for d in dims))]
        self._rank_of = {coord: rank for rank, coord in enumerate(self._coord_of)}

    def world_size(self) -> int:
        return len(self._coord_of)

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """How many ranks lie along `axis` (0 for an axis this topology does not have)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank(self, **coord: int) -> int:
        """The global rank at a full coordinate, e.g. get_rank(pipe=1, data=0)."""
        if set(coord) != set(self.axes):
            raise TopologyError(f"get_rank needs a value for every axis {self.axes}, got {sorted(coord)}")
        key = self.ProcessCoord(**coord)
        if key not in self._rank_of:
            raise TopologyError(f"coordinate {coord} is outside the topology {self._describe()}")
        return self._rank_of[key]

    def get_coord(self, rank: int) -> Any:
        """The coordinate (a namedtuple with one field per axis) of a global rank."""
        if not 0 <= rank < self.world_size():
            raise TopologyError(f"rank {rank} is outside the topology {self._describe()}")
        return self._coord_of[rank]

    def get_rank_repr(
        self,
        rank: int,
        omit_axes: Sequence[str] = (DATA, PIPE),
        inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:
        """A name for a rank's position on the kept axes, e.g. "model_01" (checkpoint file names)."""
        coord = self.get_coord(rank)
        return outer_sep.join(
            f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in omit_axes
        )

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate on `axis` is `idx`, in rank order."""
        if axis not in self.axes:
            return []
        return [rank for rank, coord in enumerate(self._coord_of) if getattr(coord, axis) == idx]

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks matching every given axis=value, in rank order."""
        unknown = set(filter_kwargs) - set(self.axes)
        if unknown:
            raise TopologyError(f"filter_match: unknown axes {sorted(unknown)}; the axes are {self.axes}")
        return [
            rank
            for rank, coord in enumerate(self._coord_of)
            if all(getattr(coord, axis) == value for axis, value in filter_kwargs.items())
        ]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups of ranks that differ only along `axis` (one list per combination of the other
        axes), each in order of that axis: the ranks that communicate along it."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, values, strict=True))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def _describe(self) -> str:
        return " x ".join(f"{axis}={dim}" for axis, dim in zip(self.axes, self.dims, strict=True))

    def __str__(self) -> str:
        return f"{type(self).__name__}({self._describe()})"

    __repr__ = __str__


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism: ranks of one stage are adjacent along data (pipe is the outer axis)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=[PIPE, DATA], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x tensor (model) parallelism; model is the innermost axis, so tensor-parallel ranks
    are adjacent (one node's fast links)."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=[PIPE, DATA, MODEL], dims=[num_pp, num_dp, num_mp])


def topology_for(world_size: int, *, pp: int = 1, tp: int = 1) -> ProcessTopology:
    """The 3-axis topology of `world_size` ranks with the given pipeline and tensor degrees (data is what is
    left); a clear error when they do not divide the world."""
    check_grid_degrees(world_size, pp=pp, tp=tp)
    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world_size // (pp * tp))


__all__ = [
    "DATA",
    "MODEL",
    "PIPE",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "ProcessTopology",
    "TopologyError",
    "topology_for",
]
