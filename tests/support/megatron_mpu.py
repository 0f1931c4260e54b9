"""A user's Megatron-style model code, for the mpu tests: an mpu object and a tensor-parallel MLP.

This is what a Megatron-LM script brings to ``initialize(mpu=...)``: its own column- and row-parallel
layers, which communicate over the model-parallel group themselves (autograd Functions around
``dist.all_reduce``), and an mpu object answering Megatron's method names. The runtime never sees these
collectives; it trains the local shards with ZeRO over the data group.

`GridMPU` answers only the newer Megatron names (get_tensor_model_parallel_*, get_pipeline_*) over a
`ParallelGrid`; a `ParallelGrid` itself answers the older ones.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime.parallel.rng import get_cuda_rng_tracker

DIM, HIDDEN = 8, 16


class GridMPU:
    """Megatron's newer mpu spelling over our grid (tensor, pipeline and data names only)."""

    def __init__(self, grid: Any) -> None:
        self.grid = grid

    def get_tensor_model_parallel_group(self) -> Any:
        return self.grid.get_model_parallel_group()

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.grid.get_model_parallel_world_size()

    def get_tensor_model_parallel_rank(self) -> int:
        return self.grid.get_model_parallel_rank()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.grid.get_pipe_parallel_world_size()

    def get_data_parallel_group(self) -> Any:
        return self.grid.get_data_parallel_group()

    def get_data_parallel_world_size(self) -> int:
        return self.grid.get_data_parallel_world_size()

    def get_data_parallel_rank(self) -> int:
        return self.grid.get_data_parallel_rank()


class _CopyToModel(torch.autograd.Function):
    """Identity forward; the input's gradient summed over the model group (each rank used the input)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromModel(torch.autograd.Function):
    """Partial outputs summed over the model group; the gradient passes through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _mark(param: nn.Parameter) -> nn.Parameter:
    param.tensor_model_parallel = True  # Megatron's mark: split over the model group
    return param


class WholeMLP(nn.Module):
    """The reference: norm -> fc1 -> gelu -> fc2 -> head, in one process."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class ParallelMLP(nn.Module):
    """`WholeMLP` split Megatron's way over the model group: fc1 column-parallel (rows of its weight and
    its bias split), fc2 row-parallel (columns of its weight split, bias whole, added after the sum);
    norm and head whole on every model rank. With `dropout`, Megatron's two kinds: on the split hidden
    features inside the tracker's fork(), on the replicated output outside it."""

    def __init__(self, whole: WholeMLP, group: Any, rank: int, size: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.group = group
        self.dropout = dropout
        rows = slice(rank * HIDDEN // size, (rank + 1) * HIDDEN // size)
        self.norm = nn.LayerNorm(DIM)
        self.norm.load_state_dict(whole.norm.state_dict())
        self.fc1_weight = _mark(nn.Parameter(whole.fc1.weight.detach()[rows].clone()))
        self.fc1_bias = _mark(nn.Parameter(whole.fc1.bias.detach()[rows].clone()))
        self.fc2_weight = _mark(nn.Parameter(whole.fc2.weight.detach()[:, rows].clone()))
        self.fc2_bias = nn.Parameter(whole.fc2.bias.detach().clone())
        self.head = nn.Linear(DIM, 1)
        self.head.load_state_dict(whole.head.state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _CopyToModel.apply(self.norm(x), self.group)
        h = F.gelu(F.linear(h, self.fc1_weight, self.fc1_bias))
        if self.dropout:  # split features: each model rank draws its own mask, from its stream
            with get_cuda_rng_tracker().fork():
                h = F.dropout(h, self.dropout, self.training)
        h = _ReduceFromModel.apply(F.linear(h, self.fc2_weight), self.group) + self.fc2_bias
        if self.dropout:  # replicated: the default stream, alike on the model ranks
            h = F.dropout(h, self.dropout, self.training)
        return self.head(h)


def whole_state(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`WholeMLP`'s state dict from the model ranks' `ParallelMLP` state dicts (in model-rank order)."""
    first = shards[0]
    return {
        "norm.weight": first["norm.weight"],
        "norm.bias": first["norm.bias"],
        "fc1.weight": torch.cat([s["fc1_weight"] for s in shards], dim=0),
        "fc1.bias": torch.cat([s["fc1_bias"] for s in shards], dim=0),
        "fc2.weight": torch.cat([s["fc2_weight"] for s in shards], dim=1),
        "fc2.bias": first["fc2_bias"],
        "head.weight": first["head.weight"],
        "head.bias": first["head.bias"],
    }


def batch(step: int, dp_rank: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Data rank `dp_rank`'s micro-batch of step `step` (the global batch: every data rank's, in order)."""
    gen = torch.Generator().manual_seed(700 + 13 * step + dp_rank)
    return torch.randn(size, DIM, generator=gen), torch.randn(size, 1, generator=gen)
