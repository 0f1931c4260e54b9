"""`PipelineModule`: a model given as a list of layers, of which each pipeline stage builds only its own.

Layers are `LayerSpec`s (a class and its arguments, built where they are needed, so a model too big for
one rank never exists whole), `TiedLayerSpec`s (layers that share weights across stages, e.g. a GPT's
embedding on the first stage and its output head on the last), ready `nn.Module`s, or plain callables.
The partition (`runtime.pipe.partition`) is computed identically on every rank; "parameters" counts each
spec's parameters by building it on the meta device (no memory, no real weights). Local layers are
registered under their global index ("3.weight"), so parameter names do not depend on the partition; a
tied layer lives in `tied_modules.<key>` once per stage.

A stage may hold several chunks (`chunks_per_stage=v`, for the interleaved schedules): the layers are cut
into `num_stages * v` parts and stage r holds parts r, r + num_stages, ...; each chunk is a `StageChunk`
that runs its own layers, and each becomes one torch `PipelineStage`. The forward pass of a chunk runs
its layers in order, handing each layer's output (a tensor or a tuple) to the next, with optional
activation checkpointing of every `activation_checkpoint_interval` layers of the chunk.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime.parallel.grid import ParallelGrid
from runtime.parallel.rng import set_random_seed
from runtime.parallel.topology import PipeDataParallelTopology, ProcessTopology
from runtime.pipe.config import PipelineError, check_module_arguments, describe_object
from runtime.pipe.partition import check_partition_method, partition_layers, virtual_stages


class LayerSpec:
    """A layer to build later: `typename(*args, **kwargs)`, on the stage that owns it."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise PipelineError(
                f"LayerSpec needs an nn.Module subclass, got {describe_object(typename)}",
                hint="pass the class and its arguments, LayerSpec(nn.Linear, 4, 8); put a plain function "
                "in the layer list as it is",
            )
        try:  # arguments that cannot reach the constructor fail here, on every rank, not when a stage builds
            inspect.signature(typename).bind(*module_args, **module_kwargs)
        except TypeError as error:
            raise PipelineError(
                f"LayerSpec({typename.__name__}, ...): the arguments do not fit {typename.__name__}"
                f"{str(inspect.signature(typename)).removesuffix(' -> None')}: {error}",
                hint="LayerSpec(cls, *args, **kwargs) builds cls(*args, **kwargs) on the stage that owns it",
            ) from None
        except ValueError:  # no signature to check (a class implemented in C): the build will tell
            pass
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


def count_trainable_params(layer: Any, *, build_for_real: bool = False) -> int:
    """Trainable parameters of a layer; specs are built on the meta device to count them, or for real
    (where the layer builds by default) when `build_for_real`: what DeepSpeed does, which draws each
    layer's initial weights from the random generator once before the stage builds its own."""
    if isinstance(layer, LayerSpec):
        if build_for_real:
            return sum(p.numel() for p in layer.build().parameters() if p.requires_grad)
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


class StageChunk(nn.Module):
    """One chunk of a stage: the layers of one part (virtual stage), run in order; what a torch
    `PipelineStage` wraps. Its layers are registered here too (so `parameters()` is the chunk's), but the
    chunk itself is not a submodule of its PipelineModule, whose names stay "3.weight"."""

    def __init__(self, owner: PipelineModule, index: int, virtual_stage: int, layers: range) -> None:
        super().__init__()
        self._owner = [owner]  # a list, so the owner is not registered as a submodule (a cycle)
        self.index = index  # this chunk's position on its stage (0 .. chunks_per_stage - 1)
        self.virtual_stage = virtual_stage  # its stage index in the pipeline of num_stages * chunks parts
        self.layers = layers  # global layer indices
        self.funcs: list[Callable[..., Any]] = []
        self.tied_modules = nn.ModuleDict()

    def add_layer(self, index: int, func: Callable[..., Any]) -> None:
        if isinstance(func, _TiedCall):
            self.tied_modules[func.key] = self._owner[0].tied_modules[func.key]
        elif isinstance(func, nn.Module):
            self.add_module(str(index), func)
        self.funcs.append(func)

    def _run(self, start: int, stop: int, x: Any) -> Any:
        for func in self.funcs[start:stop]:
            x = func(x)
        return x

    def _checkpointable(self, start: int, stop: int) -> bool:
        funcs = self.funcs[start:stop]
        names = self._owner[0].checkpointable_layers
        if names is None:
            return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)
        return any(type(f).__name__ in names for f in funcs)

    def forward(self, *inputs: Any) -> Any:
        x: Any = inputs[0] if len(inputs) == 1 else inputs
        interval = self._owner[0].activation_checkpoint_interval
        n = len(self.funcs)
        if interval == 0 or not torch.is_grad_enabled():
            return self._run(0, n, x)
        for start in range(0, n, interval):
            stop = min(start + interval, n)
            if self._checkpointable(start, stop):
                x = checkpoint(self._run, start, stop, x, use_reentrant=False)
            else:
                x = self._run(start, stop, x)
        return x


def _check_tied_attrs(spec: TiedLayerSpec, module: nn.Module) -> None:
    """Each tied_weight_attr must name a parameter of the built module: a misspelt one would leave the
    copies on the stages untied, silently (or fail deep inside the engine's broadcast)."""
    for attr in spec.tied_weight_attr:
        if not isinstance(getattr(module, attr, None), nn.Parameter):
            kind = type(module).__name__
            own = ", ".join(name for name, _ in module.named_parameters(recurse=False)) or "none"
            raise PipelineError(
                f"TiedLayerSpec({spec.key!r}, {kind}, tied_weight_attr={attr!r}): {kind} has no parameter "
                f"{attr!r} (its own: {own})"
            )


class PipelineModule(nn.Module):
    """A sequence of layers split into pipeline stages; this rank holds only its stage's layers.

    Args:
        layers: LayerSpec, TiedLayerSpec, nn.Module or callable, in forward order.
        num_stages: pipeline degree (the data-parallel degree is the world size / num_stages); or give
            `topology` (a PipeDataParallelTopology or PipeModelDataParallelTopology).
        loss_fn: `loss_fn(outputs, labels)` on the last stage.
        seed_layers: seed the random generators (`set_random_seed`: Python's, numpy's, torch's; or
            `seed_fn`) with `base_seed + layer index` before building each layer, so a layer's initial
            weights do not depend on the partition. Without it the layers draw from the generator as it
            stands, after the "parameters" partition built every spec once to count its parameters:
            DeepSpeed's order, so a seed gives DeepSpeed's initial weights either way (see `_build`).
        partition_method: "parameters" (default), "uniform" or "type:REGEX".
        activation_checkpoint_interval: checkpoint every this many layers of a chunk (0: off).
        chunks_per_stage: chunks (virtual stages) per stage, for the interleaved schedules (our
            extension; DeepSpeed has none). The layers are cut into num_stages * chunks_per_stage parts,
            stage r holding parts r, r + num_stages, ... It is an argument here, not only a config key,
            because the module builds its layers when it is constructed, before any engine reads the
            config; the config's `pipeline.chunks_per_stage`, where given, must agree.
    """

    # how runtime.config knows a pipeline without importing this package (it reads the "pipeline" section
    # for one and refuses the section for any other model)
    is_pipeline_module = True

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
        chunks_per_stage: int = 1,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise PipelineError(
                "PipelineModule needs torch.distributed, and no process group exists yet",
                hint="call runtime.init_distributed() (deepspeed.init_distributed()) before building it",
            )
        self._layer_specs = list(layers)
        if not self._layer_specs:
            raise PipelineError("PipelineModule(layers=...) is empty: a pipeline needs at least one layer")
        check_module_arguments(locals())
        check_partition_method(partition_method)
        for index, layer in enumerate(self._layer_specs):  # every rank checks every layer, not only its own
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise PipelineError(
                    f"PipelineModule layer {index} is {describe_object(layer)}: not a LayerSpec, nn.Module "
                    "or callable"
                )
        world = dist.get_world_size()
        if topology is None:
            if num_stages is None:
                raise PipelineError(
                    "PipelineModule needs num_stages=... or topology=...",
                    hint="PipelineModule(layers, num_stages=2) splits the layers over 2 stages",
                )
            if num_stages < 1 or world % num_stages != 0:
                raise PipelineError(
                    f"PipelineModule(num_stages={num_stages}) does not divide the world size {world}: every "
                    "data-parallel replica needs one rank per stage",
                    hint=f"use a num_stages that divides {world}, or launch a multiple of {num_stages} ranks",
                )
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
        elif num_stages is not None and num_stages != topology.get_dim("pipe"):
            raise PipelineError(
                f"PipelineModule(num_stages={num_stages}) but the topology has {topology.get_dim('pipe')} "
                "stages",
                hint="give one of num_stages and topology",
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
        self.chunks_per_stage = chunks_per_stage
        self.num_virtual_stages = self.num_stages * chunks_per_stage
        if chunks_per_stage > 1 and len(self._layer_specs) < self.num_virtual_stages:
            raise PipelineError(
                f"the pipeline has {self.num_stages} stages x {chunks_per_stage} chunks = "
                f"{self.num_virtual_stages} chunks but only {len(self._layer_specs)} layers; every chunk "
                "needs at least one layer",
                hint="use fewer stages or chunks_per_stage",
            )

        counts = None
        if partition_method == "parameters":
            # Unseeded layers take their weights from the generator as it stands; DeepSpeed counts by
            # building every spec for real first, so do the same draws to start the build where it does.
            real = not seed_layers
            counts = [count_trainable_params(layer, build_for_real=real) for layer in self._layer_specs]
        # boundaries of all num_stages * chunks_per_stage parts; part s is virtual stage s
        self.parts = partition_layers(
            partition_method,
            self.num_virtual_stages,
            param_counts=counts,
            type_names=[layer_type_name(layer) for layer in self._layer_specs],
        )
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.chunks: list[StageChunk] = []  # a plain list: the chunks are views, not submodules
        self._build()

    # -- construction ----------------------------------------------------------------------------------
    def _seed(self, index: int) -> None:
        if self.seed_fn is not None:
            self.seed_fn(self.base_seed + index)
        else:
            set_random_seed(self.base_seed + index)

    def _build(self) -> None:
        """Build this stage's layers in order, DeepSpeed's way, so one seed gives DeepSpeed's weights:
        with seed_layers, the generators are seeded with base_seed + index before every layer (specs,
        modules and functions alike); without, each spec draws from the generator as it stands (after
        the "parameters" count built every spec once, as DeepSpeed's does).

        A tied module is built where its key first appears on this stage, seeded (with seed_layers) by
        the key's first layer in the whole model: the weight DeepSpeed's copies hold after its broadcast
        from the lowest stage, here before the engine's broadcast too."""
        first_use: dict[str, int] = {}
        for index, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                first_use.setdefault(layer.key, index)
        for chunk_index, part in enumerate(self.virtual_stages()):
            chunk = StageChunk(self, chunk_index, part, range(self.parts[part], self.parts[part + 1]))
            for index in chunk.layers:
                chunk.add_layer(index, self._build_layer(index, first_use))
            self.chunks.append(chunk)

    def _build_layer(self, index: int, first_use: dict[str, int]) -> Callable[..., Any]:
        layer = self._layer_specs[index]
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                if self.seed_layers:
                    self._seed(first_use[layer.key])
                module = layer.build()
                _check_tied_attrs(layer, module)
                self.tied_modules[layer.key] = module
                self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            elif self.seed_layers:
                self._seed(index)
            return _TiedCall(self, layer)
        if self.seed_layers:
            self._seed(index)
        if isinstance(layer, LayerSpec):
            module = layer.build()
            self.add_module(str(index), module)
            return module
        if isinstance(layer, nn.Module):
            self.add_module(str(index), layer)
            return layer
        if callable(layer):
            return layer
        raise PipelineError(
            f"PipelineModule layer {index} is a {type(layer).__name__}: not a LayerSpec, nn.Module or "
            "callable"
        )

    def virtual_stages(self, stage: int | None = None) -> list[int]:
        """The parts (virtual stage indices) a stage holds, one per chunk; this rank's by default."""
        return virtual_stages(
            self.stage_id if stage is None else stage, self.num_stages, self.chunks_per_stage
        )

    def tied_keys_by_stage(self) -> dict[str, list[int]]:
        """For each tie key, the stages that hold a layer using it, in any of their chunks (every rank
        computes the same)."""
        stages: dict[str, list[int]] = {}
        for stage in range(self.num_stages):
            for part in self.virtual_stages(stage):
                for layer in self._layer_specs[self.parts[part] : self.parts[part + 1]]:
                    if isinstance(layer, TiedLayerSpec) and stage not in stages.setdefault(layer.key, []):
                        stages[layer.key].append(stage)
        return stages

    def tied_parameters(self, key: str) -> list[nn.Parameter]:
        module = self.tied_modules[key]
        return [getattr(module, attr) for attr in self.tied_weight_attrs[key]]

    # -- forward ---------------------------------------------------------------------------------------
    def forward(self, *inputs: Any) -> Any:
        """This stage's layers on `inputs` (one chunk per stage only: several chunks are not one
        function, the pipeline schedule runs each as its own stage)."""
        if self.chunks_per_stage > 1:
            raise RuntimeError(
                f"this PipelineModule holds {self.chunks_per_stage} chunks per stage, which run as "
                "separate pipeline stages: train it with PipelineEngine, or call module.chunks[i]"
            )
        return self.chunks[0](*inputs)

    # -- DeepSpeed's accessors -------------------------------------------------------------------------
    def topology(self) -> ProcessTopology:
        return self.grid.topology()

    def mpu(self) -> ParallelGrid:
        return self.grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def local_layer_indices(self) -> list[int]:
        """Global indices of the layers this stage holds, chunk by chunk."""
        return [index for chunk in self.chunks for index in chunk.layers]


def check_every_stage_trains(module: PipelineModule, device: torch.device) -> None:
    """A stage whose layers hold no trainable parameter (only functions, activations, frozen layers)
    has nothing for its optimizer: every rank learns the first such stage and says which, with its
    layers, instead of the optimizer's complaint on that rank alone (and the others waiting for it)."""
    trains = any(p.requires_grad for p in module.parameters())
    empty = torch.tensor([module.num_stages if trains else module.stage_id], dtype=torch.int64, device=device)
    dist.all_reduce(empty, op=dist.ReduceOp.MIN)
    stage = int(empty)
    if stage == module.num_stages:
        return
    layers = [
        i for part in module.virtual_stages(stage) for i in range(module.parts[part], module.parts[part + 1])
    ]
    names = ", ".join(f"{i}: {layer_type_name(module._layer_specs[i])}" for i in layers)
    raise PipelineError(
        f"pipeline stage {stage} holds layers {names} and no trainable parameter",
        hint="every stage needs something to train: use partition_method='parameters' (the default), "
        "fewer stages, or a layer list whose parameters spread over the stages",
    )


__all__ = [
    "LayerSpec",
    "PipelineModule",
    "StageChunk",
    "TiedLayerSpec",
    "check_every_stage_trains",
    "count_trainable_params",
    "layer_type_name",
]
