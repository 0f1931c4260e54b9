"""Topology rank arithmetic (no processes) and the grid's process groups at world 4 (gloo, in the shared
spawn of tests/support/pipe_world4.py)."""

from __future__ import annotations

import pytest

from runtime.parallel.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    topology_for,
)
from tests.support.pipe_world4 import part


def test_row_major_layout_last_axis_fastest() -> None:
    topo = ProcessTopology(axes=["a", "b"], dims=[2, 3])
    assert topo.world_size() == 6
    assert [tuple(topo.get_coord(r)) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert topo.get_rank(a=1, b=2) == 5
    assert topo.get_coord(4).a == 1 and topo.get_coord(4).b == 1
    assert topo.get_dim("b") == 3 and topo.get_dim("missing") == 0
    assert topo.get_axis_names() == ["a", "b"]


def test_pipe_data_topology_groups() -> None:
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data"]
    # ranks of one stage are adjacent: the data-parallel groups are {0,1} and {2,3}
    assert topo.get_axis_comm_lists("data") == [[0, 1], [2, 3]]
    assert topo.get_axis_comm_lists("pipe") == [[0, 2], [1, 3]]
    assert topo.get_axis_comm_lists("model") == []
    assert topo.get_axis_list("pipe", 1) == [2, 3]
    assert topo.filter_match(pipe=0) == [0, 1]
    assert topo.filter_match(pipe=1, data=0) == [2]


def test_pipe_model_data_topology() -> None:
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    assert topo.world_size() == 12
    assert topo.get_dim("model") == 2 and topo.get_dim("data") == 3
    assert topo.get_axis_comm_lists("model")[:2] == [[0, 1], [2, 3]]
    assert topo.get_axis_comm_lists("data")[0] == [0, 2, 4]
    assert topo.get_axis_comm_lists("pipe")[0] == [0, 6]
    assert topo.get_rank(pipe=1, data=2, model=1) == 11
    assert topo.get_rank_repr(11) == "model_01"
    assert topo.get_rank_repr(11, omit_axes=["data"]) == "pipe_01-model_01"
    # every rank lies in exactly one group per axis
    for axis in ("pipe", "data", "model"):
        flat = sorted(r for group in topo.get_axis_comm_lists(axis) for r in group)
        assert flat == list(range(12))


def test_bad_topologies_name_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"2 axes \['a', 'b'\] but 1 dims \[2\]"):
        ProcessTopology(["a", "b"], [2])
    with pytest.raises(ValueError, match="outside the topology pipe=2 x data=2"):
        PipeDataParallelTopology(2, 2).get_rank(pipe=2, data=0)
    with pytest.raises(ValueError, match="needs a value for every axis"):
        PipeDataParallelTopology(2, 2).get_rank(pipe=1)
    with pytest.raises(
        ValueError,
        match="3 pipeline stages x tensor-parallel degree 1 = 3 ranks per replica "
        "does not divide the world size 4",
    ):
        topology_for(4, pp=3)
    assert topology_for(8, pp=2, tp=2).get_dim("data") == 2


def _grid_worker(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    from runtime.parallel import ParallelGrid, PipeDataParallelTopology

    grid = ParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=2))
    ranks = {
        "pipe": dist.get_process_group_ranks(grid.get_pipe_parallel_group()),
        "data": dist.get_process_group_ranks(grid.get_data_parallel_group()),
        "model": dist.get_process_group_ranks(grid.get_model_parallel_group()),
    }
    # a sum over the data group reaches exactly the two ranks of this stage
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=grid.get_data_parallel_group())
    return {
        "ranks": ranks,
        "stage": grid.get_stage_id(),
        "dp_rank": grid.get_data_parallel_rank(),
        "dp_size": grid.get_data_parallel_world_size(),
        "mp_size": grid.get_model_parallel_world_size(),
        "first_last": (grid.is_first_stage(), grid.is_last_stage()),
        "last_stage_rank": grid.stage_to_global(1),
        "data_sum": value.item(),
        "mesh": grid.mesh.mesh_dim_names,
    }


def test_grid_groups_at_world_4() -> None:
    results = part("topology")
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    assert [r["dp_rank"] for r in results] == [0, 1, 0, 1]
    assert [r["ranks"]["data"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["ranks"]["pipe"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["ranks"]["model"] for r in results] == [[0], [1], [2], [3]]
    assert [r["data_sum"] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert [r["first_last"] for r in results] == [(True, False)] * 2 + [(False, True)] * 2
    assert [r["last_stage_rank"] for r in results] == [2, 3, 2, 3]
    assert all(r["dp_size"] == 2 and r["mp_size"] == 1 for r in results)
    assert results[0]["mesh"] == ("pipe", "data", "model")
