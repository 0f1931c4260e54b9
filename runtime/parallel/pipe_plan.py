"""A pipeline's parallel plan: the grid its `PipelineModule` was built on (pipe x data x model), as a
`ParallelPlan` the engine composes like any other (`build_pipeline_plan`).

The module builds its grid when it is constructed (its stage decides which layers it builds, before any
engine exists, as in DeepSpeed), so the plan takes the grid from the module instead of building one. Built
once, in this order: the config loaded for the grid's data ranks, the refusals of what a pipeline cannot
combine with (`runtime.config.combinations.check_pipeline`, before anything changes the module), AutoTP
over the grid's model axis where it has one (each stage's projections sharded, `tensor_parallel`), then
the plan's fields: the data communicator ZeRO reduces over, the model group and the sharded parameters
(the param-group split and the norm's replicated squares), the pipe axis (the norm sums over the stages;
the checkpoint folder names the stage), and the grid as the engine's mpu (activation checkpointing and
`deepspeed.utils.groups` answer with its groups).

The module is read through `StagedModule` (its grid, stages, stage and chunks), not imported: the pipeline
package sits above this one.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from torch import nn

from runtime.comm import Comm
from runtime.config import Config, load_config, read_config_file
from runtime.config.combinations import check_config_world, check_pipeline
from runtime.parallel.grid import ParallelGrid
from runtime.parallel.mpu import MpuGroups
from runtime.parallel.plan import ParallelPlan, PipeAxis
from runtime.tensor_parallel.localize import shard_for_tensor_parallel

__all__ = ["StagedModule", "build_pipeline_plan", "grid_groups"]


class StagedModule(Protocol):
    """What the plan reads of a `runtime.pipe.PipelineModule`."""

    grid: ParallelGrid
    num_stages: int
    stage_id: int
    chunks_per_stage: int


def grid_groups(grid: ParallelGrid) -> MpuGroups:
    """This rank's data and model groups of `grid` (the pipe axis is the plan's `PipeAxis`)."""
    return MpuGroups(
        data_group=grid.get_data_parallel_group(),
        data_size=grid.data_parallel_size,
        data_rank=grid.get_data_parallel_rank(),
        model_group=grid.get_model_parallel_group(),
        model_size=grid.model_parallel_size,
        model_rank=grid.get_model_parallel_rank(),
    )


def build_pipeline_plan(module: nn.Module, config: Any) -> tuple[ParallelPlan, Config]:
    """The plan of a `PipelineModule` (AutoTP applied to its stage when its topology has a model axis) and
    the config loaded once, for the grid's data ranks. `config`: a dict, a file path or a `Config`
    resolved for that size."""
    staged: StagedModule = module  # type: ignore[assignment]  # a PipelineModule, read by its protocol
    grid = staged.grid
    if isinstance(config, Config):
        check_config_world(config.world_size, grid.data_parallel_size, f"the pipeline's {grid!r}")
        cfg = config
    else:
        raw = read_config_file(config) if isinstance(config, (str, os.PathLike)) else config
        cfg = load_config(dict(raw), world_size=grid.data_parallel_size, model=module)
    tp = grid.model_parallel_size
    check_pipeline(cfg, stages=staged.num_stages, chunks_per_stage=staged.chunks_per_stage, model_dim=tp)
    sharded: frozenset[nn.Parameter] = frozenset()
    if tp > 1:  # 3D: each stage's projections sharded over the grid's model axis
        sharded = frozenset(shard_for_tensor_parallel(module, tp, grid.mesh["model"]))
    comm = Comm(
        grid.get_data_parallel_group(), emulate_reduce_scatter=not cfg.zero_optimization.reduce_scatter
    )
    pipe = PipeAxis(
        size=staged.num_stages,
        group=grid.get_pipe_parallel_group(),
        stage=staged.stage_id,
        chunks=staged.chunks_per_stage,
    )
    plan = ParallelPlan(comm, grid, grid_groups(grid), grid, tp, sharded, pipe=pipe)
    return plan, cfg
