"""How much memory a ZeRO run's model states take per GPU and per host, before running it.

Model states are the ZeRO paper's term: working weights, gradients, master weights and optimizer state.
Activations, the CUDA context and allocator fragmentation come on top and are not estimated. The numbers
follow what this runtime allocates; ``Engine.memory_breakdown()`` reports the same four quantities and
tests/runtime/estimator/test_estimator.py checks that both agree within 5% for stages 0-2 at 1, 2 and 3 ranks.

Bytes per parameter with 16-bit working weights (w = 2), fp32 master weights and Adam (8 bytes of state),
N data-parallel ranks (``N = num_gpus_per_node * num_nodes``):

    stage   weights   gradients   master   optimizer   total
    0       w         w           4        8           16
    1       w         w           4/N      8/N         4 + 12/N
    2       w         w/N         4/N      8/N         2 + 14/N
    3       w/N       w/N         4/N      8/N         16/N  (+ the largest layer, gathered)

With fp32 working weights (w = 4) the master weights are the working buffer itself whenever a rank's
shard is one contiguous range of it (one rank, one reduce bucket, or stage 3's per-unit shards), and then
cost nothing extra. Stage 3 keeps units smaller than ``stage3_param_persistence_threshold`` gathered on
every rank; the estimate assumes large units (true for models that need stage 3) and counts them sharded.

Transient device memory, counted separately: stage 2 stages gradients in reduce buckets (up to three
buckets of ``reduce_bucket_size`` elements alive: one filling, two on the wire); stage 3 holds two
gathered units (the largest "layer": a transformer block whole), with more than one rank three more for
the gradients staged for their reduce-scatters (one rank adds them straight into its shard), and the
whole gradient of its largest parameter as autograd makes it: w x (2 x unit + parameter) on one rank
with ``offload_param``, w x (5 x unit + parameter) on more, none on one rank without it (the replicated
path).

Offload (``offload_optimizer`` with device "cpu", runtime/offload): master weights, optimizer state and
the buffer the gradient shard lands in (4 + 8 + w bytes per parameter of the shard, Adam) live in host
memory of each rank; the GPU keeps the working weights and the ZeRO stage's gradient buffers. That is
the least the engine needs: on a GPU, when the host has room for it, 16-bit gradients land as fp32
instead (4 bytes, not w: runtime/offload/plan.py), for a faster host step, and by default the GPU
runs the Adam step on the state streamed from the host (runtime/offload/step/device_step.py): 12 bytes per
parameter on the host, plus an fp32 landing buffer for the part of each span the CPU updates beside it
(`offload_optimizer.host_share`), and 1-4 GiB of staging on the GPU, not counted here. Stage 3
with ``offload_param`` also keeps the weight shard on the host (the ZeRO-Infinity design; an estimate until
the engine has it). Per host: every local rank's host-resident states, or the fp32 model each process
builds on the host before the engine moves it to its GPU (4 bytes per parameter, none for stage 3 under
``zero.Init``), whichever is larger.

Model parallelism (``pipeline_parallel`` P, ``tensor_parallel`` T): the ranks form P x T x D with
D = N / (P x T) data-parallel ranks. Each rank holds one pipeline stage, about 1/P of the parameters
(the partition balances parameter counts), and of those the tensor-sharded projections' 1/T (AutoTP: the
attention and MLP weights; embeddings and norms stay whole): per rank (R + S / T) / P parameters, R
replicated and S sharded, to which the ZeRO rows above apply with D in place of N. The engines take
stages 0 and 1 with pipelines or tensor parallelism, without offload.

This module is the arithmetic only (numbers in, ``Estimate`` out, nothing printed), which is what the
tests hold against the engine and what other code may call; ``runtime.estimator.cli`` presents it: the
text table, DeepSpeed's function names and the ``ds_estimate`` command line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from torch import nn

from runtime.config.zero import ZeroConfig
from runtime.optim.muon import uses_muon
from runtime.zero.partition import plan_flat_layout
from runtime.zero.stage3_plan import plan_units

__all__ = [
    "DEFAULT_BUCKET",
    "DTYPE_BYTES",
    "MASTER_BYTES",
    "OPTIMIZER_BYTES",
    "Estimate",
    "ModelSizes",
    "StateBytes",
    "estimate",
    "estimate_all",
    "host_landing_bytes",
    "model_sizes",
    "moment_bytes",
    "state_bytes_per_param",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# bytes of optimizer state per (master) parameter
# ("muon": its momentum, for the parameters Muon updates; the rest carry AdamW's 8: see state_bytes_per_param)
OPTIMIZER_BYTES = {
    "adam": 8,
    "adamw": 8,
    "lamb": 8,
    "lion": 4,
    "sgd_momentum": 4,
    "adagrad": 4,
    "sgd": 0,
    "muon": 4,
}
MASTER_BYTES = 4  # fp32 master weights
DEFAULT_BUCKET = 500_000_000  # zero_optimization.reduce_bucket_size default (elements)
_STAGE2_BUCKETS_ALIVE = 3  # one bucket being filled + two in flight (ShardedGradStage.max_in_flight)
_STAGE3_UNITS_GATHERED = 2  # the unit computing and the one gathered ahead of it (stage3_hooks' prefetch)
# more than one rank: a unit's gradients are staged whole for its reduce-scatter, one unit filling and two
# on the wire (Stage3Options.max_in_flight); one rank adds them straight into its shard (stage3.py)
_STAGE3_UNITS_STAGED = 3


@dataclass(frozen=True)
class ModelSizes:
    """What the estimate needs to know about a model."""

    total_params: int
    # what stage 3 gathers at once: DeepSpeed's estimator takes the largest layer; ours gathers units (a
    # block with its whole subtree), so model_sizes and gpt_sizes give the largest unit here
    largest_layer_params: int | None = None
    # the largest single parameter: autograd makes its whole gradient before stage 3 takes it into the
    # shard (None: taken as the largest layer, DeepSpeed's estimator's assumption)
    largest_param: int | None = None
    numels: tuple[int, ...] | None = None  # every parameter's size: the flat layout's padding becomes exact
    tensor_parallel_params: int | None = None  # the part AutoTP shards (projection weights, colwise biases)
    muon_params: int | None = None  # the part optimizer "muon" updates with Muon (runtime.optim.muon's rule)


@dataclass(frozen=True)
class StateBytes:
    params: int = 0
    grads: int = 0
    master: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer


@dataclass(frozen=True)
class Estimate:
    """Memory of one configuration: per GPU (each rank) and per host (all local ranks)."""

    stage: int
    offload_optimizer: bool
    offload_param: bool
    gpus_per_node: int
    num_nodes: int
    gpu: StateBytes  # model states on each GPU: compare with Engine.memory_breakdown()
    gpu_transient: int  # peak extra on each GPU: stage-2 reduce buckets, stage-3 gathered layer
    host_per_rank: StateBytes  # offloaded states in host memory, per rank (grads: the landing buffer)
    host_init_per_rank: int  # the fp32 model a process builds on the host before it moves to the GPU
    pipeline_parallel: int = 1
    tensor_parallel: int = 1

    @property
    def per_gpu_bytes(self) -> int:
        return self.gpu.total + self.gpu_transient

    @property
    def per_host_bytes(self) -> int:
        return self.gpus_per_node * max(self.host_per_rank.total, self.host_init_per_rank)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["per_gpu_bytes"] = self.per_gpu_bytes
        out["per_host_bytes"] = self.per_host_bytes
        return out


def model_sizes(model: nn.Module) -> ModelSizes:
    """Parameter counts of `model`: shared parameters once; the largest "layer" is the largest of stage 3's
    gather units (a transformer block is one), which it gathers whole."""
    from runtime.tensor_parallel.autotp import tp_plan

    params = list(model.parameters())  # deduplicated (tied weights count once)
    sharded = 0
    for name, style in tp_plan(model).items():
        module = model.get_submodule(name)
        sharded += module.get_parameter("weight").numel()
        bias = getattr(module, "bias", None)
        if bias is not None and "Rowwise" not in type(style).__name__:  # a row-wise bias stays whole
            sharded += bias.numel()
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sum(p.numel() for p in params if uses_muon(names[id(p)], p, embedding))
    # what stage 3 gathers at once: its units (runtime.zero.stage3_plan: a container's child with its whole
    # subtree, e.g. a transformer block, or a module with large parameters of its own)
    units = plan_units(model, params, threshold=ZeroConfig().stage3_param_persistence_threshold)
    largest = max((unit.numel for unit in units), default=0)
    return ModelSizes(
        total_params=sum(p.numel() for p in params),
        largest_layer_params=largest,
        largest_param=max((p.numel() for p in params), default=0),
        numels=tuple(p.numel() for p in reversed(params)),  # the engine lays out in reverse order
        tensor_parallel_params=sharded,
        muon_params=muon,
    )


def rank_sizes(sizes: ModelSizes, pipeline_parallel: int, tensor_parallel: int) -> ModelSizes:
    """What one rank of a P x T model-parallel grid holds: (replicated + sharded / T) / P parameters."""
    if pipeline_parallel == 1 and tensor_parallel == 1:
        return sizes
    sharded = sizes.tensor_parallel_params
    if tensor_parallel > 1 and sharded is None:
        raise ValueError(
            "a tensor-parallel estimate needs the parameters of the sharded projections "
            "(tensor_parallel_params)"
        )
    sharded = sharded or 0
    local = math.ceil(
        (sizes.total_params - sharded + math.ceil(sharded / tensor_parallel)) / pipeline_parallel
    )
    largest = sizes.largest_layer_params
    # the exact layout is unknown
    return ModelSizes(total_params=local, largest_layer_params=largest, largest_param=sizes.largest_param)


def _stage3_transient(sizes: ModelSizes, world: int, offload_param: bool) -> int:
    """Elements stage 3 holds beyond its shards at its peak, in backward: the units gathered, the
    gradients staged for their reduce-scatters, and the one parameter's gradient autograd has just made.
    One rank without `offload_param` runs the replicated path: nothing is gathered or staged."""
    if world == 1 and not offload_param:
        return 0
    unit = sizes.largest_layer_params or 0
    staged = _STAGE3_UNITS_STAGED if world > 1 else 0
    param = sizes.largest_param if sizes.largest_param is not None else unit
    return unit * (_STAGE3_UNITS_GATHERED + staged) + param


def _flat(sizes: ModelSizes, world: int, bucket: int) -> tuple[int, int, bool]:
    """(working numel, shard numel, shard contiguous) of the engine's flat buffer for `world` shards."""
    if sizes.numels is not None:
        layout = plan_flat_layout(sizes.numels, world_size=world, bucket_numel=bucket)
        return layout.numel, layout.shard_numel, layout.shard_is_contiguous
    total = sizes.total_params
    return total, math.ceil(total / world), world == 1 or total <= bucket


def estimate(
    sizes: ModelSizes | int | float,
    *,
    stage: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    dtype: str = "bf16",
    optimizer: str = "adam",
    reduce_bucket_size: int = DEFAULT_BUCKET,
    zero_init: bool = True,
    pipeline_parallel: int = 1,
    tensor_parallel: int = 1,
    master_dtype: str = "fp32",
    state_dtype: str = "fp32",
) -> Estimate:
    """Model-state bytes of one ZeRO configuration.

    Args:
        sizes: ``model_sizes(model)``, or a parameter count (stage 3 then needs ``ModelSizes`` with
            ``largest_layer_params``).
        stage: ZeRO stage 0-3.
        num_gpus_per_node, num_nodes: the data-parallel world is their product.
        offload_optimizer: master weights and optimizer state in host memory (stages 1-3).
        offload_param: stage 3 only: the weights in host memory too.
        dtype: working-weight dtype, "bf16", "fp16" or "fp32" (master weights are always fp32).
        optimizer: one of OPTIMIZER_BYTES (bytes of state per parameter).
        reduce_bucket_size: zero_optimization.reduce_bucket_size, in elements.
        zero_init: stage 3 models built under ``runtime.zero.Init`` never exist whole on the host.
        pipeline_parallel, tensor_parallel: model-parallel degrees; the data-parallel world is the ranks
            divided by their product (stages 0 and 1, no offload).
        master_dtype, state_dtype: "bf16" for bf16.bf16_master_weights_and_grads and
            bf16.bf16_optimizer_states (stages 1-3): 2 bytes a master and half the optimizer state.
    """
    if not isinstance(sizes, ModelSizes):
        sizes = ModelSizes(total_params=_positive_int(sizes, "total_params"))
    _check_args(stage, num_gpus_per_node, num_nodes, offload_optimizer, offload_param, dtype, optimizer)
    _check_model_parallel(
        stage, num_gpus_per_node * num_nodes, pipeline_parallel, tensor_parallel, offload_optimizer
    )
    # a process builds its stage whole on the host before AutoTP shards it
    stage_params = math.ceil(sizes.total_params / pipeline_parallel)
    sizes = rank_sizes(sizes, pipeline_parallel, tensor_parallel)
    world = num_gpus_per_node * num_nodes // (pipeline_parallel * tensor_parallel)
    w = DTYPE_BYTES[dtype]
    _check_states(stage, dtype, master_dtype, state_dtype)
    master_bytes = DTYPE_BYTES[master_dtype]
    opt = moment_bytes(sizes, optimizer, state_dtype)
    if stage == 3 and sizes.largest_layer_params is None:
        raise ValueError(
            "a stage-3 estimate needs the largest layer's parameter count (largest_layer_params)"
        )

    sharded = stage >= 1 and world > 1
    numel, shard, contiguous = _flat(sizes, world if sharded else 1, reduce_bucket_size)
    # fp32: the master is this rank's range of the working buffer when that range is contiguous (stage 3
    # keeps each unit's shard as a buffer of its own, so always)
    # (bf16 masters of bf16 weights alike: runtime.zero.flat aliases whenever the dtypes agree)
    master_alias = dtype == master_dtype and (contiguous or stage == 3) and not offload_optimizer
    master = 0 if master_alias else shard * master_bytes
    transient = 0
    if stage <= 2:
        params = numel * w
        grads = shard * w if stage == 2 and world > 1 else numel * w
        if stage == 2 and world > 1:
            transient = min(numel, _STAGE2_BUCKETS_ALIVE * reduce_bucket_size) * w
    else:
        params = shard * w
        grads = shard * w
        transient = _stage3_transient(sizes, world, offload_param) * w
    host = StateBytes()
    if offload_optimizer:
        # runtime.offload.host_masters: the shard's gradients land in a host buffer of their own dtype
        # (optimizers without the one-pass Adam step also convert them into an fp32 buffer there)
        # (bf16 masters take the gradients as they land: no conversion buffer)
        landing = shard * host_landing_bytes(optimizer, dtype, master_dtype)
        host = StateBytes(grads=landing, master=shard * master_bytes, optimizer=round(shard * opt))
        gpu = StateBytes(params=params, grads=grads)
        if stage == 3 and offload_param:
            host = StateBytes(
                params=shard * w, grads=host.grads, master=host.master, optimizer=host.optimizer
            )
            gpu = StateBytes(grads=grads)
    else:
        gpu = StateBytes(params=params, grads=grads, master=master, optimizer=round(shard * opt))
    init = 0 if stage == 3 and zero_init else stage_params * 4
    return Estimate(
        stage=stage,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        gpus_per_node=num_gpus_per_node,
        num_nodes=num_nodes,
        gpu=gpu,
        gpu_transient=transient,
        host_per_rank=host,
        host_init_per_rank=init,
        pipeline_parallel=pipeline_parallel,
        tensor_parallel=tensor_parallel,
    )


def state_bytes_per_param(sizes: ModelSizes, optimizer: str) -> float:
    """Optimizer state bytes per parameter; for "muon" the mean over its Muon part (one momentum) and the
    AdamW rest (two moments). Without `muon_params` every parameter counts as AdamW's (an upper bound)."""
    if optimizer != "muon":
        return OPTIMIZER_BYTES[optimizer]
    share = (sizes.muon_params or 0) / sizes.total_params
    return share * OPTIMIZER_BYTES["muon"] + (1 - share) * OPTIMIZER_BYTES["adamw"]


def host_landing_bytes(optimizer: str, dtype: str, master_dtype: str = "fp32") -> int:
    """Host bytes an offloaded element's gradient takes (runtime.offload.host_masters): the landing buffer
    in the working dtype, and, for an optimizer without the one-pass Adam step, its conversion into the
    masters' dtype (none when the masters are in the working dtype already: bf16 masters). `ratio: "auto"`
    (runtime/offload/auto_ratio.py) counts the same bytes."""
    w, master = DTYPE_BYTES[dtype], DTYPE_BYTES[master_dtype]
    one_pass = optimizer in ("adam", "adamw") or master == w
    return w + (0 if one_pass else master)


def device_master_bytes(master_bytes: int, *, weights_on_device: bool) -> int:
    """Bytes an element of the optimizer state's device share takes for its master (`ratio` below 1):
    none for bf16 masters, which are the working weights themselves (bf16_master_weights_and_grads),
    unless ZeRO-3's offload_param keeps those in host memory (`weights_on_device` false), where the device
    share's masters are a copy of their own (runtime.offload.partial); fp32 masters always their 4.
    `ratio: "auto"` (runtime/offload/auto_ratio.py) counts the same bytes."""
    return 0 if master_bytes < MASTER_BYTES and weights_on_device else master_bytes


def moment_bytes(sizes: ModelSizes, optimizer: str, state_dtype: str = "fp32") -> float:
    """Optimizer state bytes per element of a shard (`state_bytes_per_param`), halved by bf16 states."""
    return state_bytes_per_param(sizes, optimizer) * DTYPE_BYTES[state_dtype] / 4


def _positive_int(value: int | float, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return int(value)


def _check_model_parallel(stage: int, ranks: int, pp: int, tp: int, offload: bool) -> None:
    for name, value in (("pipeline_parallel", pp), ("tensor_parallel", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if pp * tp == 1:
        return
    if ranks % (pp * tp):
        raise ValueError(
            f"pipeline_parallel {pp} x tensor_parallel {tp} = {pp * tp} does not divide the {ranks} rank(s)"
        )
    if stage >= 2 or offload:
        raise ValueError(
            f"pipeline or tensor parallelism trains with ZeRO stage 0 or 1 without offload, not stage {stage}"
            + (" with offload" if offload else "")
        )


def _check_args(
    stage: int,
    gpus: int,
    nodes: int,
    offload_optimizer: bool,
    offload_param: bool,
    dtype: str,
    optimizer: str,
) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    for name, value in (("num_gpus_per_node", gpus), ("num_nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if offload_optimizer and stage == 0:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3")
    if offload_param and (stage != 3 or not offload_optimizer):
        raise ValueError("offload_param needs stage 3 and offload_optimizer (as in DeepSpeed)")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_BYTES)}, got {optimizer!r}")


def _check_states(stage: int, dtype: str, master_dtype: str, state_dtype: str) -> None:
    for name, value in (("master_dtype", master_dtype), ("state_dtype", state_dtype)):
        if value not in ("fp32", "bf16"):
            raise ValueError(f"{name} must be fp32 or bf16, got {value!r}")
    if master_dtype == "bf16" and (stage == 0 or dtype != "bf16"):
        raise ValueError("bf16 master weights need ZeRO stage 1-3 and bf16 working weights")
    if state_dtype == "bf16" and master_dtype != "bf16":
        raise ValueError("bf16 optimizer states need bf16 master weights")


def estimate_all(
    sizes: ModelSizes | int | float,
    *,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    stages: Sequence[int] = (0, 1, 2, 3),
    **options: object,
) -> list[Estimate]:
    """Every stage and offload choice in `stages` (stage 3 only when the largest layer is known; with
    pipeline or tensor parallelism only stages 0 and 1 without offload, what those engines train)."""
    if not isinstance(sizes, ModelSizes):
        sizes = ModelSizes(total_params=_positive_int(sizes, "total_params"))
    degrees = [options.get(key, 1) for key in ("pipeline_parallel", "tensor_parallel")]
    model_parallel = degrees != [1, 1]
    out = []
    for stage in stages:
        if stage == 3 and sizes.largest_layer_params is None:
            continue
        if stage == 0 and options.get("master_dtype", "fp32") != "fp32":
            continue  # bf16 masters are ZeRO 1-3's
        if model_parallel and stage >= 2:
            continue
        choices = [(False, False)]
        if stage >= 1 and not model_parallel:
            choices.append((True, False))
        if stage == 3:
            choices.append((True, True))
        for offload_optimizer, offload_param in choices:
            out.append(
                estimate(
                    sizes,
                    stage=stage,
                    num_gpus_per_node=num_gpus_per_node,
                    num_nodes=num_nodes,
                    offload_optimizer=offload_optimizer,
                    offload_param=offload_param,
                    **options,  # type: ignore[arg-type]
                )
            )
    return out
