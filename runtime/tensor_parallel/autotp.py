"""AutoTP: shard Hugging Face-style transformer blocks over the grid's model axis with DTensor plans.

`tp_model_init(model, tp_size, dtype)` finds the projections by name and applies
`torch.distributed.tensor.parallel` styles over `grid.mesh["model"]` (DTensor does every collective):

- Llama-style `nn.Linear`: q_proj, k_proj, v_proj, gate_proj, up_proj colwise; o_proj, down_proj rowwise.
- GPT-2-style `Conv1D` (weight stored (in, out), `x @ W + b`): c_attn, c_fc colwise; c_proj rowwise. torch's
  styles only take nn.Linear / nn.Embedding, so `Conv1DColwise` / `Conv1DRowwise` are the same plans with
  the weight's dims swapped, built on `distribute_module`.

A fused q|k|v projection (GPT-2's c_attn) has its output columns reordered before sharding so that rank r
holds the r-th slice of each of q, k and v; the attention module's head counts and `split_size` become
the local ones. `full_state_dict(model)` undoes both and returns the Hugging Face layout, whole.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from runtime.config.parallel import check_grid_degrees
from runtime.distributed import current_device
from runtime.errors import UserError

COLWISE_NAMES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "c_attn", "c_fc")
ROWWISE_NAMES = ("o_proj", "down_proj", "c_proj")
FUSED_QKV_NAMES = ("c_attn",)
HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_head", "split_size")
_PERMUTED = "_autotp_fused_qkv"  # attribute on a fused projection: the degree its columns were reordered for


class TensorParallelError(UserError, ValueError):
    """A model the tensor-parallel degree cannot split (heads or widths not divisible, nothing to shard)."""

    hint = (
        'choose a "tensor_parallel": {"autotp_size": N} that divides the heads and the projection widths '
        "the message names (a ValueError as before)"
    )


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (by name: transformers need not be installed): weight (in, out), attr nf.
    The MRO is searched because a parametrized module's class is a generated subclass."""
    return any(cls.__name__ == "Conv1D" for cls in type(module).__mro__) and hasattr(module, "nf")


class Conv1DColwise(ParallelStyle):
    """Column-wise (output features) sharding of a Conv1D: weight Shard(1), bias Shard(0)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(mod.named_parameters(recurse=False)):
                placement = Shard(1) if key == "weight" else Shard(0)
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [placement])))

        def inputs(mod: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            return (x, *args[1:])

        def outputs(mod: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return out.redistribute(mesh, [Shard(-1)]).to_local()

        # torch annotates input_fn / output_fn as returning None, but they are installed as forward hooks
        # whose return value replaces the inputs / output, which is what these two do
        return distribute_module(module, device_mesh, partition, inputs, outputs)  # type: ignore[arg-type]


class Conv1DRowwise(ParallelStyle):
    """Row-wise (input features) sharding of a Conv1D: weight Shard(0), bias replicated; the partial
    outputs are summed over the model group."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(mod.named_parameters(recurse=False)):
                placement = Shard(0) if key == "weight" else Replicate()
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [placement])))

        def inputs(mod: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Shard(-1)], run_check=False)
            return (x, *args[1:])

        def outputs(mod: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return out.redistribute(mesh, [Replicate()]).to_local()

        # torch annotates input_fn / output_fn as returning None, but they are installed as forward hooks
        # whose return value replaces the inputs / output, which is what these two do
        return distribute_module(module, device_mesh, partition, inputs, outputs)  # type: ignore[arg-type]


def _leaf_name(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The plan for every projection of `model` that AutoTP knows, by module path."""
    plan: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        leaf = _leaf_name(name)
        conv = is_conv1d(module)
        if not (conv or isinstance(module, nn.Linear)):
            continue
        if leaf in COLWISE_NAMES:
            plan[name] = Conv1DColwise() if conv else ColwiseParallel()
        elif leaf in ROWWISE_NAMES:
            plan[name] = Conv1DRowwise() if conv else RowwiseParallel()
    return plan


def _fused_order(total: int, tp_size: int) -> torch.Tensor:
    """Column order putting the r-th slice of q, k and v together in chunk r (q|k|v of equal width)."""
    width = total // 3
    piece = width // tp_size
    return torch.cat(
        [
            torch.arange(part * width + r * piece, part * width + (r + 1) * piece)
            for r in range(tp_size)
            for part in range(3)
        ]
    )


def _reorder_fused(module: nn.Module, tp_size: int) -> None:
    weight = module.get_parameter("weight")
    total = weight.shape[1] if is_conv1d(module) else weight.shape[0]
    if total % (3 * tp_size):
        raise TensorParallelError(
            f"tensor_parallel.autotp_size {tp_size}: the fused q|k|v width {total} is not divisible by "
            f"3 x {tp_size}"
        )
    order = _fused_order(total, tp_size)
    with torch.no_grad():
        dim = 1 if is_conv1d(module) else 0
        weight.copy_(weight.index_select(dim, order))
        if getattr(module, "bias", None) is not None:
            bias = module.get_parameter("bias")
            bias.copy_(bias.index_select(0, order))
    setattr(module, _PERMUTED, tp_size)


def _localize_heads(model: nn.Module, plan: dict[str, ParallelStyle], tp_size: int) -> None:
    """Divide the head counts (and GPT-2's split_size) of every module holding a sharded projection."""
    parents = {name.rsplit(".", 1)[0] for name in plan if "." in name}
    for name, module in model.named_modules():
        if name not in parents:
            continue
        for attr in HEAD_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                if value % tp_size:
                    raise TensorParallelError(
                        f"tensor_parallel.autotp_size {tp_size} does not divide {name}.{attr} = {value}"
                    )
                setattr(module, attr, value // tp_size)


def _check_divisible(model: nn.Module, plan: dict[str, ParallelStyle], tp_size: int) -> None:
    for name, style in plan.items():
        module = model.get_submodule(name)
        shape = tuple(module.get_parameter("weight").shape)
        colwise = isinstance(style, (ColwiseParallel, Conv1DColwise))
        dim = (1 if colwise else 0) if is_conv1d(module) else (0 if colwise else 1)
        if shape[dim] % tp_size:
            raise TensorParallelError(
                f"tensor_parallel.autotp_size {tp_size} does not divide dim {dim} ({shape[dim]}) of the "
                f"weight {name} of shape {shape}"
            )


def nothing_to_shard(model: nn.Module, tp_size: int) -> TensorParallelError:
    """The error for a model none of whose layers AutoTP knows by name: it names the ones it saw, since
    training on would keep every weight whole on every rank (tensor parallelism in name only)."""
    seen = [
        f"{name} ({type(module).__name__})"
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.Conv1d)) or is_conv1d(module)
    ]
    found = (
        f"its layers with weights to split are {', '.join(seen[:6])}" if seen else "it has no Linear layer"
    )
    more = f" and {len(seen) - 6} more" if len(seen) > 6 else ""
    known = ", ".join(COLWISE_NAMES[:5] + ROWWISE_NAMES[:2])
    return TensorParallelError(
        f"tensor_parallel.autotp_size {tp_size}: AutoTP finds no projection to shard in "
        f"{type(model).__name__}: it knows Linear layers named {known}"
        f" and Conv1D layers named c_attn, c_fc, c_proj; {found}{more}",
        hint='use "autotp_size": 1 (no tensor parallelism) for this model, or name its projections as '
        "Hugging Face's Llama or GPT-2 blocks do",
    )


def tp_model_init(
    model: nn.Module,
    tp_size: int,
    dtype: torch.dtype | None = None,
    *,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard `model`'s attention and MLP projections over `tp_size` ranks (in place; returns it).

    Args:
        model: a Hugging Face-style model (Llama-style Linear or GPT-2-style Conv1D blocks), whole on
            every rank of the model group, with equal weights there.
        tp_size: the tensor-parallel degree; must divide the world size, the heads and the sizes.
        dtype: cast the model to this dtype first (None: keep).
        mesh: the 1-D model mesh; default: the model axis of a data x model mesh over the world, the
            ranks `runtime.parallel.ParallelGrid(topology_for(world, tp=tp_size))` gives that axis.
    """
    if tp_size < 1:
        raise TensorParallelError(f"tensor-parallel degree must be at least 1, got {tp_size}")
    if dtype is not None:
        model.to(dtype)
    if mesh is None:
        mesh = _default_model_mesh(tp_size)
    if mesh.size() != tp_size:
        raise TensorParallelError(f"the model mesh has {mesh.size()} ranks but tp_size is {tp_size}")
    plan = tp_plan(model)
    if not plan:
        raise nothing_to_shard(model, tp_size)
    if tp_size == 1:
        return model
    _check_divisible(model, plan, tp_size)
    _localize_heads(model, plan, tp_size)
    for name in plan:
        if _leaf_name(name) in FUSED_QKV_NAMES:
            _reorder_fused(model.get_submodule(name), tp_size)
    return parallelize_module(model, mesh, plan)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights in the original (Hugging Face) layout; every rank of the model group must call
    it (sharded tensors are gathered). Parametrized parameters (the engine's local shards) are read
    through their parametrization, under their plain names."""
    out: dict[str, torch.Tensor] = {}
    fused = {name: getattr(m, _PERMUTED) for name, m in model.named_modules() if hasattr(m, _PERMUTED)}
    for key, value in model.state_dict().items():
        if ".parametrizations." in key or key.startswith("parametrizations."):
            owner, _, rest = key.rpartition("parametrizations.")
            leaf = rest.split(".", 1)[0]
            owner = owner.rstrip(".")
            key = f"{owner}.{leaf}" if owner else leaf
            value = getattr(model.get_submodule(owner), leaf)
        tensor = value.full_tensor() if isinstance(value, DTensor) else value
        owner, _, leaf = key.rpartition(".")
        if owner in fused:
            module = model.get_submodule(owner)
            dim = 1 if (is_conv1d(module) and leaf == "weight") else 0
            order = _fused_order(tensor.shape[dim], fused[owner])
            tensor = tensor.index_select(dim, torch.argsort(order))
        out[key] = tensor.detach().clone()
    return out


def local_numel(model: nn.Module) -> int:
    """Elements of the parameters this rank holds (its shards of the sharded ones)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def _default_model_mesh(tp_size: int) -> DeviceMesh:
    """The model axis of (data, model) over the world: model ranks adjacent, as the grid lays them out
    (the grid itself is runtime.parallel's; this package only shards, so it builds the mesh alone)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    check_grid_degrees(world, tp=tp_size)
    shape = (world // tp_size, tp_size)
    return init_device_mesh(current_device().type, shape, mesh_dim_names=("data", "model"))["model"]


__all__ = [
    "Conv1DColwise",
    "Conv1DRowwise",
    "TensorParallelError",
    "full_state_dict",
    "is_conv1d",
    "local_numel",
    "tp_model_init",
    "tp_plan",
]
