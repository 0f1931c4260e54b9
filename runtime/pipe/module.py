"""`PipelineModule`: a model given as a list of layers, of which each pipeline stage builds only its own.

Layers are `LayerSpec`s (a class and its arguments, built where they are needed, so a model too big for
one rank never exists whole), `TiedLayerSpec`s (layers that share weights across stages, e.g. a GPT's
embedding on the first stage and its output head on the last), ready `nn.Module`s, or plain callables.
The partition (`runtime.pipe.partition`) is computed identically on every rank; "parameters" counts each
spec's parameters by building it on the meta device (no memory, no real weights). Local layers are
registered under their global index ("3.weight"), so parameter names do not depend on the partition; a
tied layer lives in `tied_modules.<key>` once per stage.

The forward pass runs the local layers in order, handing each layer's output (a tensor or a tuple) to the
next, with optional activation checkpointing of every `activation_checkpoint_interval` layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime.parallel.grid import ParallelGrid
from runtime.parallel.topology import PipeDataParallelTopology, ProcessTopology
from runtime.pipe.partition import check_partition_method, partition_layers


class LayerSpec:
    """A layer to build later: `typename(*args, **kwargs)`, on the stage that owns it."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec needs an nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose `tied_weight_attr` parameters are one weight wherever `key` appears.

    Stages holding the key each build the module; the copies start equal (broadcast from the lowest stage)
    and stay equal because their gradients are summed over the stages holding the key before each step.
    `forward_fn(module, inputs)` replaces `module(inputs)` where given (a head that multiplies by the
    embedding's weight).
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = "weight",
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = (
            [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        )


def layer_type_name(layer: Any) -> str:
    """The class name the "type:REGEX" partition matches against."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def count_trainable_params(layer: Any) -> int:
    """Trainable parameters of a layer; specs are built on the meta device to count them."""
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            module = layer.build()
    elif isinstance(layer, nn.Module):
        module = layer
    else:
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


class _TiedCall(nn.Module):
    """Placeholder in the layer sequence for one use of a tied module (it holds no parameters itself)."""

    def __init__(self, owner: PipelineModule, spec: TiedLayerSpec) -> None:
        super().__init__()
        self._owner = [owner]  # a list, so the owner is not registered as a submodule (a cycle)
        self.key = spec.key
        self.forward_fn = spec.forward_fn

    def forward(self, inputs: Any) -> Any:
        module = self._owner[0].tied_modules[self.key]
        return module(inputs) if self.forward_fn is None else self.forward_fn(module, inputs)


class PipelineModule(nn.Module):
    """A sequence of layers split into pipeline stages; this rank holds only its stage's layers.

    Args:
        layers: LayerSpec, TiedLayerSpec, nn.Module or callable, in forward order.
        num_stages: pipeline degree (the data-parallel degree is the world size / num_stages); or give
            `topology` (a PipeDataParallelTopology or PipeModelDataParallelTopology).
        loss_fn: `loss_fn(outputs, labels)` on the last stage.
        seed_layers: seed the RNG with `base_seed + layer index` before building each layer, so a layer's
            initial weights do not depend on the partition.
        partition_method: "parameters" (default), "uniform" or "type:REGEX".
        activation_checkpoint_interval: checkpoint every this many layers (0: off).
    """

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        checkpointable_layers: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "PipelineModule needs torch.distributed; call runtime.init_distributed() first"
            )
        self._layer_specs = list(layers)
        if not self._layer_specs:
            raise ValueError("PipelineModule needs at least one layer")
        check_partition_method(partition_method)
        if activation_checkpoint_interval < 0:
            raise ValueError(
                f"activation_checkpoint_interval must be >= 0, got {activation_checkpoint_interval}"
            )
        world = dist.get_world_size()
        if topology is None:
            if num_stages is None:
                raise ValueError("PipelineModule needs num_stages or topology")
            if num_stages < 1 or world % num_stages != 0:
                raise ValueError(
                    f"num_stages={num_stages} does not divide the world size {world}: every data-parallel "
                    "replica needs one rank per stage"
                )
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
        elif num_stages is not None and num_stages != topology.get_dim("pipe"):
            raise ValueError(
                f"num_stages={num_stages} but the topology has {topology.get_dim('pipe')} stages"
            )
        self.grid = ParallelGrid(topology)
        self.num_stages = self.grid.pipe_parallel_size
        self.stage_id = self.grid.stage_id
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.checkpointable_layers = list(checkpointable_layers) if checkpointable_layers else None

        counts = None
        if partition_method == "parameters":
            counts = [count_trainable_params(layer) for layer in self._layer_specs]
        self.parts = partition_layers(
            partition_method,
            self.num_stages,
            param_counts=counts,
            type_names=[layer_type_name(layer) for layer in self._layer_specs],
        )
        self._local_start = self.parts[self.stage_id]
        self._local_stop = self.parts[self.stage_id + 1]
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.forward_funcs: list[Callable[..., Any]] = []
        self._build()

    # -- construction ----------------------------------------------------------------------------------
    def _seed(self, index: int) -> None:
        if self.seed_fn is not None:
            self.seed_fn(self.base_seed + index)
        else:
            torch.manual_seed(self.base_seed + index)

    def _build(self) -> None:
        for index in range(self._local_start, self._local_stop):
            layer = self._layer_specs[index]
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    if self.seed_layers:
                        self._seed(index)
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                self.forward_funcs.append(_TiedCall(self, layer))
            elif isinstance(layer, LayerSpec):
                if self.seed_layers:
                    self._seed(index)
                module = layer.build()
                self.add_module(str(index), module)
                self.forward_funcs.append(module)
            elif isinstance(layer, nn.Module):
                self.add_module(str(index), layer)
                self.forward_funcs.append(layer)
            elif callable(layer):
                self.forward_funcs.append(layer)
            else:
                raise TypeError(
                    f"layer {index} is {type(layer).__name__}: not a LayerSpec, nn.Module or callable"
                )

    def tied_keys_by_stage(self) -> dict[str, list[int]]:
        """For each tie key, the stages that hold a layer using it (every rank computes the same)."""
        stages: dict[str, list[int]] = {}
        for stage in range(self.num_stages):
            for layer in self._layer_specs[self.parts[stage] : self.parts[stage + 1]]:
                if isinstance(layer, TiedLayerSpec) and stage not in stages.setdefault(layer.key, []):
                    stages[layer.key].append(stage)
        return stages

    def tied_parameters(self, key: str) -> list[nn.Parameter]:
        module = self.tied_modules[key]
        return [getattr(module, attr) for attr in self.tied_weight_attrs[key]]

    # -- forward ---------------------------------------------------------------------------------------
    def _run(self, start: int, stop: int, x: Any) -> Any:
        for func in self.forward_funcs[start:stop]:
            x = func(x)
        return x

    def _checkpointable(self, start: int, stop: int) -> bool:
        funcs = self.forward_funcs[start:stop]
        if self.checkpointable_layers is None:
            return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)
        return any(type(f).__name__ in self.checkpointable_layers for f in funcs)

    def forward(self, *inputs: Any) -> Any:
        x: Any = inputs[0] if len(inputs) == 1 else inputs
        interval = self.activation_checkpoint_interval
        n = len(self.forward_funcs)
        if interval == 0 or not torch.is_grad_enabled():
            return self._run(0, n, x)
        for start in range(0, n, interval):
            stop = min(start + interval, n)
            if self._checkpointable(start, stop):
                x = checkpoint(self._run, start, stop, x, use_reentrant=False)
            else:
                x = self._run(start, stop, x)
        return x

    # -- DeepSpeed's accessors -------------------------------------------------------------------------
    def topology(self) -> ProcessTopology:
        return self.grid.topology()

    def mpu(self) -> ParallelGrid:
        return self.grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def local_layer_indices(self) -> range:
        """Global indices of the layers this stage holds."""
        return range(self._local_start, self._local_stop)


__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "count_trainable_params", "layer_type_name"]
