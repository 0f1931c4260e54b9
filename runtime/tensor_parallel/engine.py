"""`TensorParallelEngine`: AutoTP over the grid's model axis composed with the ZeRO engine over data.

The config's `"tensor_parallel": {"autotp_size": N}` shards the model with `tp_model_init` on a
pipe=1 x data x model=N grid. The ZeRO machinery flattens plain tensors, so each sharded parameter is then
re-registered as its local shard (a plain Parameter) behind a parametrization that wraps it back into the
DTensor on every access (`DTensor.from_local`, differentiable): the forward still runs the DTensor plans,
and the gradients land, local, in the engine's flat buffers, to be reduced over data as usual.

The engine is `runtime.parallel.mpu_engine.MpuEngine` with the grid as the model-parallel unit: ZeRO
stages 0-2 over data, and the gradient norm counts every weight once (sharded parameters are summed over
the model group; the parameters every tensor-parallel rank holds whole, such as norms, embeddings and
row-wise biases, are kept in their own param groups, whose squares are scaled by 1/tp before that sum).
A client optimizer built on the whole model, or `model_parameters` naming its parameters, is mapped onto
the shards by parameter name.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import parametrize

from runtime.config import Config, read_config_file
from runtime.config.combinations import check_tensor_parallel, check_tensor_parallel_world
from runtime.config.parallel import tensor_parallel_degree
from runtime.parallel import ParallelGrid, topology_for
from runtime.parallel.mpu import MpuGroups
from runtime.parallel.mpu_engine import MpuEngine, replicated_squares
from runtime.tensor_parallel.autotp import tp_model_init


class _FromLocal(nn.Module):
    """Parametrization: this rank's shard -> the DTensor the plans compute with."""

    def __init__(self, like: DTensor) -> None:
        super().__init__()
        self.mesh = like.device_mesh
        self.placements = like.placements
        self.shape = like.shape
        self.stride = like.stride()

    def forward(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


def localize_parameters(model: nn.Module) -> set[nn.Parameter]:
    """Re-register every DTensor parameter as its local shard behind a `_FromLocal` parametrization;
    returns the local shards of the parameters that are split over the model group."""
    sharded: set[nn.Parameter] = set()
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                continue
            local = nn.Parameter(param.to_local().detach().clone(), requires_grad=param.requires_grad)
            wrap = _FromLocal(param)
            del module._parameters[name]
            module.register_parameter(name, local)
            parametrize.register_parametrization(module, name, wrap, unsafe=True)
            if any(p.is_shard() for p in wrap.placements):
                sharded.add(module.parametrizations[name].original)
    return sharded


def shard_for_tensor_parallel(model: nn.Module, tp_size: int, mesh: Any) -> set[nn.Parameter]:
    """AutoTP `model` over `mesh`, local shards as its parameters; returns the shards split over the
    model axis (the engine splits its param groups by them). A model with nothing to shard (a pipeline
    stage of only embeddings and norms) stays whole."""
    from runtime.tensor_parallel.autotp import tp_plan

    if tp_plan(model):
        tp_model_init(model, tp_size, mesh=mesh)
    return localize_parameters(model)


class TensorParallelEngine(MpuEngine):
    """The ZeRO engine (stages 0-2) over the data group of a model sharded with AutoTP: `MpuEngine` with
    the grid as the mpu and the DTensor shards as the split parameters."""

    def __init__(
        self,
        model: nn.Module,
        config: Any,
        *,
        optimizer: Any = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
    ) -> None:
        raw = dict(read_config_file(config) if isinstance(config, (str, os.PathLike)) else config)
        tp = tensor_parallel_degree(raw)
        world = dist.get_world_size()
        check_tensor_parallel_world(tp, world)
        grid = ParallelGrid(topology_for(world, tp=tp))
        # the user's parameters (a client optimizer's groups, model_parameters) by name, before AutoTP
        # replaces them with their shards
        names = {param: name for name, param in model.named_parameters()}
        # the whole model: nothing to shard is an error (a pipeline stage may hold none, see above)
        tp_model_init(model, tp, mesh=grid.mesh["model"])
        sharded = localize_parameters(model)
        now = {_plain_name(name): param for name, param in model.named_parameters()}
        super().__init__(
            model,
            raw,
            mpu=grid,
            optimizer=optimizer,
            model_parameters=model_parameters,
            lr_scheduler=lr_scheduler,
            sharded=sharded,
            renamed={param: now[name] for param, name in names.items() if name in now},
        )
        self.grid = grid
        self.tp_size = tp

    def _check_combination(self, config: Config, groups: MpuGroups) -> None:
        """AutoTP stops at ZeRO stage 2 (config/combinations)."""
        check_tensor_parallel(config, groups.describe())

    def checkpoint_folder(self) -> tuple[str, str, str]:
        """Each model rank keeps its own ZeRO checkpoint (its shards of the sharded projections, over its
        data group); the name carries the degree, so a resume at another degree is caught."""
        rank, size = self.grid.get_model_parallel_rank(), self.tp_size
        return f"tp_rank_{rank:02d}_of_{size:02d}", "tp_rank_", f"tensor-parallel rank {rank} of {size}"

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model in the Hugging Face layout (weights gathered over the model group, the fused
        q|k|v order undone); every rank must call it."""
        from runtime.tensor_parallel.autotp import full_state_dict

        self.masters.flush()
        return full_state_dict(self.module)


def _plain_name(name: str) -> str:
    """A parametrized parameter's name as the module had it ("c_attn.weight", not
    "c_attn.parametrizations.weight.original")."""
    return re.sub(r"(^|\.)parametrizations\.([^.]+)\.original$", r"\1\2", name)


__all__ = [
    "TensorParallelEngine",
    "localize_parameters",
    "replicated_squares",
    "shard_for_tensor_parallel",
]
