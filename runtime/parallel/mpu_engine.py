"""`MpuEngine`: the ZeRO engine over the data group of a model-parallel unit (``initialize(mpu=...)``).

The model arrives already split by the user's code (Megatron's column- and row-parallel layers, which do
their own collectives over the model group); the engine only has to train it as data parallelism over
the mpu's data group, with three differences from the plain engine:

- ZeRO partitions and reduces over the data group (the engine's `Comm` is built on it), and the batch
  arithmetic counts data-parallel ranks, not the world;
- the gradient norm (clipping, the non-finite verdict) is summed over the model group as well, each
  weight once: a parameter split over the model group (`is_model_parallel_parameter`) contributes its
  shard's squares on every model rank, one whole on every model rank (unmarked) 1/model-size of them;
  such parameters are kept in param groups of their own so their squares can be taken apart;
- each model rank keeps its own checkpoint folder (``mp_rank_RR_of_NN``), as its shards differ.

ZeRO stages 0-3 (stage 3 partitions the local shards over the data group and gathers them there).
`TensorParallelEngine` (AutoTP) is this engine with our `ParallelGrid` as the mpu and the DTensor shards
as the split parameters; it stops at stage 2.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runtime import activation_checkpointing
from runtime.comm import Comm
from runtime.config import Config, load_config, read_config_file
from runtime.config.combinations import check_batch_over_data, check_config_world, check_mpu
from runtime.engine import Engine
from runtime.parallel.mpu import MpuGroups, is_model_parallel_parameter, resolve_mpu
from runtime.parallel.norm import grid_square_sum
from runtime.precision.grad_math import GradMath
from runtime.zero.optimizer import GroupSpec, OptimizerSource, collect_param_groups

__all__ = ["MpuEngine", "replicated_squares", "split_specs"]


def split_specs(specs: list[GroupSpec], sharded: set[nn.Parameter]) -> tuple[list[GroupSpec], set[int]]:
    """Each param group split into its model-parallel (sharded) and its replicated parameters, with the
    same options and user group; returns the groups and the indices of the replicated ones."""
    out: list[GroupSpec] = []
    replicated: set[int] = set()
    for spec in specs:
        for is_sharded in (True, False):
            part = [p for p in spec.params if (p in sharded) == is_sharded]
            if part:
                if not is_sharded:
                    replicated.add(len(out))
                out.append(GroupSpec(part, dict(spec.options), spec.source))
    return out, replicated


def replicated_squares(engine: Engine, replicated_specs: set[int]) -> torch.Tensor | None:
    """Sum of squares of this rank's reduced gradients of the parameters every model rank holds whole
    (the param groups in `replicated_specs`), in the units of the engine's norm; None when there are
    none. Call it where the norm is computed: the gradients are reduced by then."""
    pieces = [
        piece.float()
        for group, group_pieces in zip(engine.groups, engine.zero.grad_pieces(), strict=True)
        if group.spec_index in replicated_specs
        for piece in group_pieces
    ]
    if not pieces:
        return None
    return torch.stack([torch.linalg.vector_norm(p) for p in pieces]).square().sum()


def _config_for(config: Any, groups: MpuGroups, model: nn.Module) -> Config:
    """The config resolved for the data-parallel ranks (train_batch_size counts them, not the world)."""
    if isinstance(config, Config):
        check_config_world(config.world_size, groups.data_size, groups.describe())
        return config
    raw = dict(read_config_file(config) if isinstance(config, (str, os.PathLike)) else config)
    total = f"{groups.describe()} = {groups.model_size * groups.data_size} ranks"
    check_batch_over_data(raw, groups.data_size, total)
    return load_config(raw, world_size=groups.data_size, model=model)


class MpuEngine(Engine):
    """ZeRO stages 0-3 over an mpu's data group; the norm over its model group."""

    model_parallel = True

    def __init__(
        self,
        model: nn.Module,
        config: Any,
        *,
        mpu: Any,
        optimizer: OptimizerSource | None = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
        sharded: set[nn.Parameter] | None = None,
        renamed: Mapping[torch.Tensor, nn.Parameter] | None = None,
    ) -> None:
        """`sharded`: the parameters split over the model group (default: the marked ones);
        `renamed`: the parameters the user holds -> the model's own (after the engine's caller replaced
        them, as AutoTP does), so a client optimizer's or `model_parameters`' groups still apply."""
        groups = resolve_mpu(mpu)
        cfg = _config_for(config, groups, model)
        self._check_combination(cfg, groups)
        # read by _param_group_specs, which Engine.__init__ calls
        self._sharded = sharded if sharded is not None else _marked(model)
        self._renamed = dict(renamed or {})
        self._replicated_specs: set[int] = set()
        super().__init__(
            model,
            cfg,
            optimizer=optimizer,
            model_parameters=model_parameters,
            lr_scheduler=lr_scheduler,
            comm=Comm(groups.data_group, emulate_reduce_scatter=not cfg.zero_optimization.reduce_scatter),
        )
        self.mpu = mpu
        self.mpu_groups = groups
        self.mp_size = groups.model_size
        activation_checkpointing.use_engine_mpu(mpu)
        self._engine_mpu = mpu

    def _check_combination(self, config: Config, groups: MpuGroups) -> None:
        """The user's mpu brings a model already split: AutoTP on top is refused (config/combinations)."""
        check_mpu(config)

    def _param_group_specs(
        self, model: nn.Module, optimizer: OptimizerSource | None, model_parameters: Any
    ) -> list[GroupSpec]:
        if self._renamed and (isinstance(optimizer, torch.optim.Optimizer) or model_parameters is not None):
            specs = collect_param_groups(model, None, self._renamed_groups(optimizer, model_parameters))
        else:
            specs = collect_param_groups(model, optimizer, model_parameters)
        specs, self._replicated_specs = split_specs(specs, self._sharded)
        return specs

    def _renamed_groups(self, optimizer: Any, model_parameters: Any) -> list[dict[str, Any]]:
        """The user's groups (one dict each, so group indices stay the user's) over the model's own
        parameters."""
        if isinstance(optimizer, torch.optim.Optimizer):
            user = optimizer.param_groups
        else:
            items = list(model_parameters)
            user = items if items and isinstance(items[0], dict) else [{"params": items}]
        out = []
        for group in user:
            params = group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            out.append({**group, "params": [self._renamed.get(p, p) for p in params]})
        return out

    def _grad_math(self) -> GradMath:
        math = super()._grad_math()
        if self.mp_size == 1:
            return math
        return dataclasses.replace(math, all_reduce_sum=self._model_group_sum(math.all_reduce_sum))

    def _model_group_sum(self, dp_sum: Any) -> Any:
        """Sum of squared gradients over data and the model group, each weight once (runtime.parallel.norm):
        every model rank holds a replicated parameter's same gradient, so each adds 1/size of it."""
        return grid_square_sum(
            dp_sum,
            model_size=self.mp_size,
            model_group=self.mpu_groups.model_group,
            replicated=lambda: replicated_squares(self, self._replicated_specs),
        )

    def checkpoint_folder(self) -> tuple[str, str, str] | None:
        """Each model rank keeps its own ZeRO checkpoint; the name carries the size, so a resume at
        another model-parallel size is caught by name."""
        if self.mp_size == 1:
            return None
        rank = self.mpu_groups.model_rank
        return (
            f"mp_rank_{rank:02d}_of_{self.mp_size:02d}",
            "mp_rank_",
            f"model-parallel rank {rank} of {self.mp_size}",
        )


def _marked(model: nn.Module) -> set[nn.Parameter]:
    return {p for p in model.parameters() if is_model_parallel_parameter(p)}
