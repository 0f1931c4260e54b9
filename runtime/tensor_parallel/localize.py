"""AutoTP's shards as plain parameters: what lets the ZeRO machinery, which flattens plain tensors, train a
model `tp_model_init` sharded.

Each DTensor parameter is re-registered as its local shard (a plain Parameter) behind a parametrization
that wraps it back into the DTensor on every access (`DTensor.from_local`, differentiable): the forward
still runs the DTensor plans, and the gradients land, local, in the engine's flat buffers, to be reduced
over data as usual. The grid, the config and the engine are the parallel plan's
(runtime.parallel.plan); this module only shards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import parametrize

from runtime.tensor_parallel.autotp import tp_model_init, tp_plan


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
                lists: Any = module.parametrizations  # a ModuleDict of ParametrizationLists
                sharded.add(lists[name].original)
    return sharded


def shard_for_tensor_parallel(model: nn.Module, tp_size: int, mesh: Any) -> set[nn.Parameter]:
    """AutoTP `model` over `mesh`, local shards as its parameters; returns the shards split over the
    model axis (the engine splits its param groups by them). A model with nothing to shard (a pipeline
    stage of only embeddings and norms) stays whole."""
    if tp_plan(model):
        tp_model_init(model, tp_size, mesh=mesh)
    return localize_parameters(model)


__all__ = ["localize_parameters", "shard_for_tensor_parallel"]
