"""`ParallelPlan`: how one engine's model is spread over the ranks, built once by `build_parallel_plan`.

In the spirit of torchtitan's `ParallelDims`: one object holds everything the engine needs to know about
the axes beyond plain data parallelism, so the engine composes it instead of being subclassed per kind:

- the data communicator (`comm`) ZeRO partitions and reduces over, and the data size the batch
  arithmetic counts (the config is loaded for it);
- the model group and its size, over which the gradient norm is summed as well (`runtime.parallel.norm`);
- the parameters split over the model group (`sharded`); every other parameter is whole on each model
  rank and sits in param groups of its own (`split_specs`), so its squares are counted once;
- the user's parameters mapped onto the model's own (`renamed`: AutoTP replaces them with local shards);
- the checkpoint sub-folder of this model rank.

Four sources make a plan: a user's model-parallel unit (``initialize(mpu=...)``: Megatron-style layers
that do their own collectives), Ulysses sequence groups passed as that mpu (runtime.sequence.sp_groups:
ZeRO over data x sequence, the mean over the data ranks), AutoTP (``tensor_parallel.autotp_size``: the
plan builds the grid and shards the model), and plain data parallelism (the trivial plan). A pipeline's
plan (`runtime.parallel.pipe_plan.build_pipeline_plan`) is the grid its `PipelineModule` was built on: the
same fields, plus the pipe axis (`PipeAxis`: the stage group the norm sums over, this rank's stage, the
chunks per stage the checkpoint folder names).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch
import torch.distributed as dist
from torch import nn

from runtime.comm import Comm
from runtime.config import Config, ConfigError, load_config, read_config_file
from runtime.config.batch import BatchSizeError
from runtime.config.combinations import (
    check_batch_over_data,
    check_config_world,
    check_mpu,
    check_tensor_parallel,
    check_tensor_parallel_world,
)
from runtime.config.parallel import tensor_parallel_degree
from runtime.parallel.grid import ParallelGrid
from runtime.parallel.mpu import MpuGroups, is_model_parallel_parameter, resolve_mpu
from runtime.parallel.norm import grid_square_sum
from runtime.parallel.topology import topology_for
from runtime.precision.grad_math import GradMath
from runtime.tensor_parallel.autotp import tp_model_init
from runtime.tensor_parallel.localize import localize_parameters
from runtime.zero.optimizer import GroupSpec

__all__ = ["ParallelPlan", "PipeAxis", "build_parallel_plan", "replicated_squares", "split_specs"]


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


def replicated_squares(engine: Any, replicated_specs: set[int]) -> torch.Tensor | None:
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


@dataclass(frozen=True)
class PipeAxis:
    """A pipeline's stages as the plan sees them (the schedules are `PipelineEngine`'s)."""

    size: int  # stages
    group: dist.ProcessGroup  # this rank's pipeline, one rank per stage
    stage: int  # this rank's stage
    chunks: int = 1  # chunks (virtual stages) per stage

    def folder(self, model_rank: int, model_size: int) -> tuple[str, str, str]:
        """Each stage (and, in 3D, each model rank of a stage) keeps its own ZeRO checkpoint, all its chunks
        in one; the name carries the degrees and the chunks per stage, so a resume at another degree or
        with other chunks is caught."""
        name = f"pipe_stage_{self.stage:02d}_of_{self.size:02d}"
        what = f"stage {self.stage} of {self.size}"
        if self.chunks > 1:
            name += f"_chunks_{self.chunks:02d}"
            what += f" with {self.chunks} chunks"
        if model_size > 1:  # 3D: the model ranks of a stage hold different shards
            name += f"_tp_{model_rank:02d}_of_{model_size:02d}"
            what += f", tensor-parallel rank {model_rank} of {model_size}"
        return name, "pipe_stage_", what


@dataclass(frozen=True)
class ParallelPlan:
    """The axes of one engine beyond data parallelism. `mpu is None`: plain data parallelism."""

    comm: Comm | None = None  # None: the engine's default (the whole world)
    mpu: Any = None  # what checkpointing and deepspeed.utils.groups read the groups from
    groups: MpuGroups | None = None
    grid: ParallelGrid | None = None  # ours, when the plan built it (AutoTP)
    tp_size: int = 1  # the AutoTP degree (1: none, or the user's own layers)
    sharded: frozenset[nn.Parameter] = field(default_factory=frozenset)
    renamed: Mapping[torch.Tensor, nn.Parameter] = field(default_factory=dict)
    # Ulysses: the ranks sharing one sequence. `comm` spans data x sequence; they hold the same weights
    # and each back-propagates its share of its sample's mean loss, so their gradients add up
    sequence_size: int = 1
    pipe: PipeAxis | None = None  # a pipeline's stages (its grid is `grid`, its model axis `groups`)

    def mean_ranks(self, comm_size: int) -> int:
        """The ranks the gradient mean divides by: the data ranks of `comm` (a sequence's ranks sum)."""
        return comm_size // self.sequence_size

    def data_ranks(self) -> tuple[int, int] | None:
        """(data-parallel size, this rank's place) the samples are split over; None: the world."""
        if self.groups is not None:
            return self.groups.data_size, self.groups.data_rank
        if self.sequence_size > 1:
            return self.mpu.get_data_parallel_world_size(), self.mpu.get_data_parallel_rank()
        return None

    @property
    def model_parallel(self) -> bool:
        return self.groups is not None

    @property
    def model_size(self) -> int:
        return 1 if self.groups is None else self.groups.model_size

    def own_parameters(self, optimizer: Any, model_parameters: Any) -> tuple[Any, Any]:
        """(optimizer, model_parameters) over the model's own parameters: where the plan replaced the
        user's (AutoTP's shards), the user's groups mapped onto them by name and given as
        model_parameters (one dict each, so group indices stay the user's); else as given."""
        user = self._user_groups(optimizer, model_parameters)
        return (optimizer, model_parameters) if user is None else (None, user)

    def _user_groups(self, optimizer: Any, model_parameters: Any) -> list[dict[str, Any]] | None:
        """The user's groups (one dict each, so group indices stay the user's) over the model's own
        parameters; None when nothing was renamed or the user named no parameters."""
        if not self.renamed:
            return None
        if isinstance(optimizer, torch.optim.Optimizer):
            user = optimizer.param_groups
        elif model_parameters is not None:
            items = list(model_parameters)
            user = items if items and isinstance(items[0], dict) else [{"params": items}]
        else:
            return None
        out = []
        for group in user:
            params = group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            out.append({**group, "params": [self.renamed.get(p, p) for p in params]})
        return out

    def split(self, specs: list[GroupSpec]) -> tuple[list[GroupSpec], set[int]]:
        """The one param-group split: unsplit for plain data parallelism and for a pipeline without a
        model axis (nothing of it is sharded); returns the groups and the indices of the replicated ones."""
        if not self.model_parallel or (self.pipe is not None and self.tp_size == 1):
            return specs, set()
        return split_specs(specs, set(self.sharded))

    def grad_math(
        self,
        math: GradMath,
        replicated: Callable[[], torch.Tensor | None],
        duplicates: Callable[[], torch.Tensor | None] | None = None,
    ) -> GradMath:
        """The step's gradient math with the squared-norm sum taken over the pipe and model axes too, each
        weight once (`replicated`: this rank's squares of the parameters every model rank holds whole;
        `duplicates`: a pipeline's tied copies this stage holds but does not own, None without ties)."""
        if self.groups is None:
            return math
        pipe = self.pipe
        if pipe is None and self.groups.model_size == 1:
            return math
        return dataclasses.replace(
            math,
            all_reduce_sum=grid_square_sum(
                math.all_reduce_sum,
                model_size=self.groups.model_size,
                model_group=self.groups.model_group,
                pipe_size=1 if pipe is None else pipe.size,
                pipe_group=None if pipe is None else pipe.group,
                replicated=replicated,
                duplicates=None if pipe is None else duplicates,
            ),
        )

    def checkpoint_folder(self, size: int) -> tuple[str, str, str] | None:
        """(this model rank's sub-folder, the family's prefix, what it holds); `size` is the degree the
        engine states (a test may change it to read a checkpoint as if saved at another degree)."""
        if self.groups is None:
            return None
        rank = self.groups.model_rank
        if self.pipe is not None:
            return self.pipe.folder(rank, size)
        if self.tp_size > 1:
            return f"tp_rank_{rank:02d}_of_{size:02d}", "tp_rank_", f"tensor-parallel rank {rank} of {size}"
        if size == 1:
            return None
        return f"mp_rank_{rank:02d}_of_{size:02d}", "mp_rank_", f"model-parallel rank {rank} of {size}"


def build_parallel_plan(
    model: nn.Module, config: Any, *, mpu: Any = None, world_size: int | None = None
) -> tuple[ParallelPlan, Config]:
    """The plan for `model` (AutoTP applied to it when the config asks) and the config loaded once, for
    the data-parallel size. `config`: a dict, a file path or a loaded `Config` (then it must have been
    resolved for that size)."""
    world = dist.get_world_size() if world_size is None else world_size
    raw = None if isinstance(config, Config) else _raw(config)
    if mpu is not None and hasattr(mpu, "get_sequence_data_parallel_group"):
        return _sequence_plan(model, config, raw, mpu)
    tp = 1 if raw is None else tensor_parallel_degree(raw)
    if mpu is None and tp == 1:
        if raw is not None:
            return ParallelPlan(), load_config(raw, world_size=world, model=model)
        if config.world_size != world:
            raise ValueError(
                f"the config was resolved for world_size {config.world_size}, but the job has {world} ranks"
            )
        return ParallelPlan(), config
    grid = None
    if mpu is None:
        check_tensor_parallel_world(tp, world)
        grid = mpu = ParallelGrid(topology_for(world, tp=tp))
    groups = resolve_mpu(mpu)
    cfg = _config_for(config, raw, groups, model)
    comm = Comm(groups.data_group, emulate_reduce_scatter=not cfg.zero_optimization.reduce_scatter)
    if grid is None:
        check_mpu(cfg)  # the user's mpu brings a model already split: AutoTP on top is refused
        sharded = {p for p in model.parameters() if is_model_parallel_parameter(p)}
        return ParallelPlan(comm, mpu, groups, sharded=frozenset(sharded)), cfg
    check_tensor_parallel(cfg, groups.describe())  # AutoTP stops at ZeRO stage 2
    # the user's parameters (a client optimizer's groups, model_parameters) by name, before AutoTP
    # replaces them with their shards
    names = {param: name for name, param in model.named_parameters()}
    tp_model_init(model, tp, mesh=grid.mesh["model"])  # nothing to shard is an error here
    sharded = localize_parameters(model)
    now = {_plain_name(name): param for name, param in model.named_parameters()}
    renamed: dict[torch.Tensor, nn.Parameter] = {p: now[name] for p, name in names.items() if name in now}
    return ParallelPlan(comm, grid, groups, grid, tp, frozenset(sharded), renamed), cfg


def _sequence_plan(
    model: nn.Module, config: Any, raw: dict[str, Any] | None, mpu: Any
) -> tuple[ParallelPlan, Config]:
    """Ulysses sequence groups (runtime.sequence.sp_groups): ZeRO over data x sequence, the batch
    arithmetic and the gradient mean over the data ranks; the config's `sequence_parallel_size`, where
    given, must agree with the groups."""
    sp, dp = mpu.get_sequence_parallel_world_size(), mpu.get_data_parallel_world_size()
    if raw is None:
        assert isinstance(config, Config)
        check_config_world(config.world_size, dp, f"{mpu!r}")
        cfg = config
    else:
        given = raw.pop("sequence_parallel_size", None)
        if given is not None and given != sp:
            raise ConfigError(
                "sequence_parallel_size",
                f"{given} disagrees with the sequence groups passed as mpu ({mpu!r})",
                hint=f"set it to {sp}, or leave it out (the groups decide)",
            )
        batch = {k: raw.get(k) for k in _BATCH_KEYS}
        try:
            cfg = load_config(raw, world_size=dp, model=model)
        except BatchSizeError:
            raise sequence_batch_error(batch, sp, dp) from None
    comm = Comm(
        mpu.get_sequence_data_parallel_group(),
        emulate_reduce_scatter=not cfg.zero_optimization.reduce_scatter,
    )
    return ParallelPlan(comm, mpu, sequence_size=sp), cfg


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def sequence_batch_error(batch: Mapping[str, Any], sp: int, dp: int) -> ConfigError:
    """The batch arithmetic's refusal under Ulysses groups, saying what to set. Accelerate's
    ``ParallelismConfig(sp_backend="deepspeed")`` writes train_batch_size = micro x accumulation x its
    dp_shard_size x dp_replicate_size, and a user who leaves dp_shard_size at 1 gets a batch counting one
    data rank where the groups leave ``dp``: that case is named, with the value to set."""
    tbs, micro = batch.get("train_batch_size"), batch.get("train_micro_batch_size_per_gpu")
    gas = batch.get("gradient_accumulation_steps")
    gas = 1 if gas is None else gas
    if _is_count(tbs) and _is_count(micro) and _is_count(gas):
        return ConfigError(
            "train_batch_size",
            f"{tbs} counts {tbs / (micro * gas):g} data-parallel ranks (train_micro_batch_size_per_gpu "
            f"{micro} x gradient_accumulation_steps {gas}), but the {sp * dp} ranks in sequence groups of "
            f'{sp} leave {dp}; with Accelerate\'s ParallelismConfig(sp_backend="deepspeed") set '
            f"dp_shard_size={dp}",
            hint=f"--parallelism_config_dp_shard_size {dp} (Accelerate's and the Trainer's flag); in a "
            f"DeepSpeed config, train_batch_size={micro * gas * dp} or leave it out",
        )
    return ConfigError(
        "train_batch_size",
        f"must be train_micro_batch_size_per_gpu x gradient_accumulation_steps x {dp}: the {sp * dp} "
        f"ranks in sequence groups of {sp} leave {dp} data-parallel ranks",
        hint="give train_micro_batch_size_per_gpu alone, and train_batch_size is derived",
    )


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _raw(config: Any) -> dict[str, Any]:
    return dict(read_config_file(config) if isinstance(config, (str, os.PathLike)) else config)


def _config_for(config: Any, raw: dict[str, Any] | None, groups: MpuGroups, model: nn.Module) -> Config:
    """The config resolved for the data-parallel ranks (train_batch_size counts them, not the world)."""
    if raw is None:
        assert isinstance(config, Config)
        check_config_world(config.world_size, groups.data_size, groups.describe())
        return config
    total = f"{groups.describe()} = {groups.model_size * groups.data_size} ranks"
    check_batch_over_data(raw, groups.data_size, total)
    return load_config(raw, world_size=groups.data_size, model=model)


def _plain_name(name: str) -> str:
    """A parametrized parameter's name as the module had it ("c_attn.weight", not
    "c_attn.parametrizations.weight.original")."""
    return re.sub(r"(^|\.)parametrizations\.([^.]+)\.original$", r"\1\2", name)
