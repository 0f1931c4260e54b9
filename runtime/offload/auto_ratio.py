"""`"ratio": "auto"`: the host's share of the optimizer state, chosen when the engine starts.

The engine resolves it before the ZeRO stage groups the parameters (the split is structural: whole
parameters go to one side, runtime/zero/offload_split.py), so it cannot measure a step first. It reads
the facts once (`read_auto_facts`: the model's sizes, the device's memory, the host's) and the choice is
a pure function of them (`auto_ratio`, over the budget arithmetic of `choose_ratio`, both here beside the
facts they read): the device keeps the largest share of the state that fits beside

- the working weights, the gradient buffers and the stage's transient buffers (what
  runtime/estimator/model_states.py counts for this stage and offload, the same numbers `ds_estimate`
  uses), and the device step's staging;
- the activations of one micro-batch: estimated from the model's shape where it says it (a GPT of
  runtime.models, or a Hugging Face config: width, depth, vocabulary, positions) with the formula of
  runtime/estimator/fit.py, and otherwise a fixed share of the device (`UNKNOWN_ACTIVATION_SHARE`);
  or, at the step, once backward has freed them, the fp32 gradient copy of the device's share and room
  for that single allocation again (`auto_ratio` says why), whichever is larger;
- a reserve for the allocator's fragmentation and temporaries (`ALLOCATOR_SLACK` of the device).

The host takes the rest, and if the host cannot hold it either, the engine stops before the first step
with both sides' numbers and the number of elements they could hold together (`choose_ratio`).

Why the device first: it updates its share at memory bandwidth, while the host's share costs a CPU step
and the copies; and the host is what runs out first for the largest models. Every rank reads its own
machine; the ranks then take the largest host share any of them needs (`agree_on_ratio`), because the split
must be the same on all of them.

The engine's way in is `with_auto_ratio`, through the package's front door (runtime.offload): the config
with the ratio resolved, before the ZeRO stage is built.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from runtime.comm import Comm
from runtime.config import Config, OptimizerConfig
from runtime.config.reader import ConfigError
from runtime.estimator.fit import (  # ds_estimate's constants: both plan a machine alike
    ALLOCATOR_SLACK,
    DEVICE_STEP_STAGING_BYTES,
    FRAGMENTATION_BYTES,
    GIB,
    Workload,
    activation_bytes,
)
from runtime.estimator.model_states import (
    DTYPE_BYTES,
    MASTER_BYTES,
    OPTIMIZER_BYTES,
    device_master_bytes,
    estimate,
    host_landing_bytes,
    model_sizes,
    moment_bytes,
)
from runtime.memory import host_available_bytes
from runtime.models.gpt import GPTConfig
from runtime.zero.offload_split import RATIO_KEY

_log = logging.getLogger("runtime.offload")
UNKNOWN_ACTIVATION_SHARE = 0.25  # of the device, for activations, when the model does not say its shape
LONGEST_ASSUMED_SEQUENCE = 8192  # a model may allow 128k positions; its batches rarely fill them
HOST_RESERVE_BYTES = 2 * GIB  # left to the process itself, its data loader and the page cache
STATE_BYTES = MASTER_BYTES + OPTIMIZER_BYTES["adamw"]  # fp32 master + Adam's two moments, per element
LANDING_BYTES = DTYPE_BYTES["bf16"]  # the 16-bit gradient landing buffer of a host update, per element


@dataclass(frozen=True)
class ActivationGuess:
    """Peak activation bytes of one micro-batch, and where the number comes from (for the log)."""

    nbytes: int
    source: str


@dataclass(frozen=True)
class AutoFacts:
    """What `auto_ratio` decides from, read once when the engine starts."""

    shard_numel: int  # this rank's optimizer shard, in elements
    fixed_device_bytes: int  # weights, gradients and transient buffers the stage keeps on the device
    device_capacity: int  # the device's memory less what other processes (and our CUDA context) hold
    host_available: int
    activations: ActivationGuess
    working_bytes: int  # bytes of a working-weight element: a 16-bit one makes the device step copy fp32
    # bf16.bf16_master_weights_and_grads / bf16_optimizer_states: bf16 masters (the device share's are the
    # working weights themselves, stepped without an fp32 gradient copy) and half-size moments
    master_bytes: int = MASTER_BYTES
    # the optimizer's state an element, as the estimator counts it: Muon's is the mean of its momentum (4)
    # over its matrices and AdamW's moments (8) over the rest (estimator.model_states.moment_bytes)
    moment_bytes: float = OPTIMIZER_BYTES["adamw"]
    # the host's gradient landing (and, for an optimizer without the one-pass Adam step, the conversion
    # into fp32 masters: estimator.model_states.host_landing_bytes)
    landing_bytes: int = LANDING_BYTES
    # the working weights live on the device: with ZeRO-3's offload_param they are in host memory, so the
    # device share's bf16 masters are a copy of their own there (runtime.offload.partial)
    weights_on_device: bool = True

    @property
    def bf16_masters(self) -> bool:
        return self.master_bytes < MASTER_BYTES

    @property
    def device_state_bytes(self) -> float:
        """An element of the device's share: its master (none when it is the working weight on the device)
        and moments."""
        master = device_master_bytes(self.master_bytes, weights_on_device=self.weights_on_device)
        return master + self.moment_bytes

    @property
    def host_state_bytes(self) -> float:
        """An element of the host's share: master, moments and the gradient landing buffer."""
        return self.master_bytes + self.moment_bytes + self.landing_bytes


@dataclass(frozen=True)
class RatioChoice:
    """The share of the optimizer state to put on the host, and why (the engine logs the reason)."""

    ratio: float
    reason: str


def choose_ratio(
    *,
    shard_numel: int,
    device_bytes_per_element: float,
    host_bytes_per_element: float,
    device_free: int,
    activation_bytes: int,
    device_reserve: int,
    host_available: int,
    step_bytes_per_element: float = 0,
    step: float = 0.01,
) -> RatioChoice:
    """`"ratio": "auto"`: the largest device share of the optimizer state that fits beside the rest.

    Args:
        shard_numel: this rank's optimizer shard, in elements (what either side can hold).
        device_bytes_per_element: what an element of state costs on the device at the step's peak: the
            fp32 master (unless it is the working weights themselves), the optimizer's moments, and the
            fp32 gradient copy the step makes from 16-bit gradients (16 for Adam with bf16 weights).
        host_bytes_per_element: the same on the host, with the offload's landing buffers (14 or 16).
        device_free: device bytes free once the working weights and gradient buffers exist.
        activation_bytes: the activations' peak estimate for the configured micro-batch.
        device_reserve: what to leave free besides (allocator fragmentation, temporaries, communication).
        host_available: host bytes this rank may still allocate.
        step_bytes_per_element: device bytes an element of the device's share costs only during the
            optimizer step, after backward has freed the activations (the fp32 gradient copy, and room
            for its single allocation): they take the activations' place, not a place beside them.
        step: the ratio is a multiple of this, rounded towards the host, so the device share stays
            inside its budget (the split then takes at least that share to the host: `at_least`).

    Returns the ratio (0.0: all of the state fits on the device) and a reason naming the numbers; raises
    ValueError, naming them and what would fit, when the device and the host together cannot hold it.
    """
    if min(shard_numel, device_bytes_per_element, host_bytes_per_element) <= 0:
        raise ValueError("choose_ratio needs a positive shard size and positive bytes per element")
    gib = 1 << 30
    budget = max(0, device_free - activation_bytes - device_reserve)
    on_device = min(shard_numel, int(budget // device_bytes_per_element))
    if step_bytes_per_element:  # the step's peak: the state and the step's buffers, without activations
        per_element = device_bytes_per_element + step_bytes_per_element
        at_step = int(max(0, device_free - device_reserve) // per_element)
        on_device = min(on_device, at_step)
    ratio = 1.0 - on_device / shard_numel
    ratio = min(1.0, math.ceil(round(ratio / step, 9)) * step)  # whole steps, towards the host
    ratio = round(ratio, 6)
    host_need = math.ceil(math.ceil(ratio * shard_numel) * host_bytes_per_element)
    device_use = (shard_numel - math.ceil(ratio * shard_numel)) * device_bytes_per_element
    spare = f"{budget / gib:.1f} GiB of the device's {device_free / gib:.1f} GiB free after the activations "
    spare += f"({activation_bytes / gib:.1f} GiB) and a reserve of {device_reserve / gib:.1f} GiB"
    if step_bytes_per_element:
        step_gib = (shard_numel - math.ceil(ratio * shard_numel)) * step_bytes_per_element / gib
        spare = (
            f"the device's {device_free / gib:.1f} GiB free, less a reserve of "
            f"{device_reserve / gib:.1f} GiB, "
            f"beside the activations ({activation_bytes / gib:.1f} GiB) in forward and backward and the "
            f"step's buffers ({step_gib:.1f} GiB) after them"
        )
    if host_need > host_available:
        fits = on_device + int(host_available // host_bytes_per_element)
        raise ValueError(
            f"the optimizer state of this rank's {shard_numel:,} elements does not fit: the device can hold "
            f"{on_device:,} of them ({spare}) and the host the rest only with {host_need / gib:.1f} GiB, of "
            f"{host_available / gib:.1f} GiB available; both together hold about {fits:,} elements"
        )
    device_gib = device_use / gib
    if ratio == 0.0:
        return RatioChoice(0.0, f"ratio 0: all of the optimizer state ({device_gib:.1f} GiB) fits in {spare}")
    if ratio == 1.0:
        host = f"{host_need / gib:.1f} GiB of {host_available / gib:.1f} GiB available"
        why = f"ratio 1: no optimizer state fits on the device ({spare}); the host holds all of it ({host})"
        return RatioChoice(1.0, why)
    return RatioChoice(
        ratio,
        f"ratio {ratio:g}: the device keeps {1 - ratio:.0%} of the optimizer state ({device_gib:.1f} GiB), "
        f"what fits in {spare}; the host holds the rest ({host_need / gib:.1f} GiB of "
        f"{host_available / gib:.1f} GiB available)",
    )


def device_bytes_per_element(facts: AutoFacts) -> float:
    """Device bytes an element of the device's share costs: its state, and the fp32 copy the device's step
    makes of a 16-bit gradient (runtime.precision.mixed)."""
    copy = 4 if facts.working_bytes < 4 and not facts.bf16_masters else 0
    return facts.device_state_bytes + copy


def auto_ratio(facts: AutoFacts) -> RatioChoice:
    """The host's share of the optimizer state for `facts` (see the module docstring); ValueError when the
    device and the host together cannot hold it.

    Each element the device keeps costs its state all the time, and at the step, once backward has freed
    the activations, its fp32 gradient copy and that copy again: the copy is one allocation of the whole
    share, and the caching allocator must find it in one piece. Measured on the H200 (GPT 13.48B, ZeRO-2,
    bf16): at ratio 0.60 the step's 19 GiB copy failed with 14.9 GiB free and 14.4 GiB reserved but
    unallocated; at 0.68, what this budget chooses, it trained with a 115 GiB peak, the same with and
    without activation checkpointing (the activations are gone by the step)."""
    slack = int(ALLOCATOR_SLACK * facts.device_capacity) + DEVICE_STEP_STAGING_BYTES
    step_bytes = device_bytes_per_element(facts) - facts.device_state_bytes
    if step_bytes:
        step_bytes += FRAGMENTATION_BYTES
    choice = choose_ratio(
        shard_numel=facts.shard_numel,
        device_bytes_per_element=facts.device_state_bytes,
        step_bytes_per_element=step_bytes,
        host_bytes_per_element=facts.host_state_bytes,
        device_free=max(0, facts.device_capacity - facts.fixed_device_bytes),
        activation_bytes=facts.activations.nbytes,
        device_reserve=slack,
        host_available=max(0, facts.host_available - HOST_RESERVE_BYTES),
    )
    fixed = facts.fixed_device_bytes / GIB
    why = (
        f"{choice.reason}; the device's {facts.device_capacity / GIB:.1f} GiB also hold {fixed:.1f} GiB of "
        f"weights and gradient buffers; activations: {facts.activations.source}"
    )
    return RatioChoice(choice.ratio, why)


def ratio_shortfall(facts: AutoFacts, ratio: float) -> str | None:
    """Why a set `ratio` cannot train (None: it may): the state alone, without activations, overfills the
    device or the host. Only certain failures are refused; the activations are a guess."""
    host_numel = math.ceil(ratio * facts.shard_numel)
    device_numel = facts.shard_numel - host_numel
    device_need = facts.fixed_device_bytes + math.ceil(device_numel * device_bytes_per_element(facts))
    host_need = math.ceil(host_numel * facts.host_state_bytes)
    short = []
    if device_need > facts.device_capacity:
        short.append(
            f"the device needs {device_need / GIB:.1f} GiB for weights, gradients and its {1 - ratio:.0%} "
            f"of the optimizer state, before activations, and has {facts.device_capacity / GIB:.1f} GiB"
        )
    if host_need > facts.host_available:
        short.append(
            f"the host needs {host_need / GIB:.1f} GiB for its {ratio:.0%} of the optimizer state and has "
            f"{facts.host_available / GIB:.1f} GiB available"
        )
    if not short:
        return None
    try:
        would = f'"auto" would choose {auto_ratio(facts).ratio:g}'
    except ValueError as exc:
        would = f"no ratio fits: {exc}"
    shard = f"{ratio:g} cannot train this model's {facts.shard_numel:,}-element shard"
    return f"{shard}: {'; '.join(short)}; {would}"


def model_shape(model: nn.Module) -> dict[str, int] | None:
    """Width, depth, vocabulary and positions of a transformer that says them in its `config` (a GPT of
    runtime.models or a Hugging Face model), else None."""
    config = getattr(model, "config", None)

    def first(*names: str) -> int | None:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    shape = {
        "width": first("n_embd", "hidden_size", "d_model"),
        "layers": first("n_layer", "num_hidden_layers", "num_layers"),
        "vocab": first("vocab_size"),
        "positions": first("max_seq_len", "n_positions", "max_position_embeddings"),
    }
    return None if any(v is None for v in shape.values()) else shape  # type: ignore[return-value]


def checkpointed(model: nn.Module) -> bool:
    """Whether the model recomputes its blocks in backward (runtime.models' `checkpoint_fn`, or Hugging
    Face's gradient checkpointing)."""
    return getattr(model, "checkpoint_fn", None) is not None or bool(
        getattr(model, "is_gradient_checkpointing", False)
    )


def _dtype_name(working_bytes: int) -> str:
    """The estimator's name for a working-weight element of this size (16-bit unless fp32)."""
    return "fp32" if working_bytes == 4 else "bf16"


def guess_activations(
    model: nn.Module, micro_batch: int, working_bytes: int, capacity: int
) -> ActivationGuess:
    """Peak activations of one micro-batch (runtime/estimator/fit.py's formula) from the model's shape."""
    shape = model_shape(model)
    if shape is None:
        nbytes = int(UNKNOWN_ACTIVATION_SHARE * capacity)
        return ActivationGuess(
            nbytes,
            f"{nbytes / GIB:.1f} GiB ({UNKNOWN_ACTIVATION_SHARE:.0%} of the device: the model does not say "
            f"its width, depth and vocabulary in .config; set {RATIO_KEY} to a number to choose yourself)",
        )
    seq = min(shape["positions"], LONGEST_ASSUMED_SEQUENCE)
    heads = 1  # the formula does not depend on the heads; GPTConfig wants a divisor of the width
    config = GPTConfig(
        n_layer=shape["layers"],
        n_head=heads,
        n_embd=shape["width"],
        vocab_size=shape["vocab"],
        max_seq_len=seq,
    )
    recompute = checkpointed(model)
    dtype = _dtype_name(working_bytes)
    work = Workload(seq_len=seq, micro_batch=micro_batch, activation_checkpointing=recompute, dtype=dtype)
    nbytes = activation_bytes(config, work)
    where = "checkpointed blocks" if recompute else "every block's activations kept"
    return ActivationGuess(
        nbytes,
        f"{nbytes / GIB:.1f} GiB for micro batch {micro_batch} x {seq} tokens of a {shape['layers']}-layer "
        f"model of width {shape['width']} ({where}; sequence = the model's positions"
        f"{f', at most {LONGEST_ASSUMED_SEQUENCE}' if shape['positions'] > seq else ''})",
    )


def read_auto_facts(
    model: nn.Module, config: Config, comm: Comm, device: torch.device, working_dtype: torch.dtype
) -> AutoFacts:
    """This rank's facts for `auto_ratio`: the model's sizes and the memory the machine reports now."""
    zero = config.zero_optimization
    sizes = model_sizes(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # the optimizer's elements
    working_bytes = torch.empty((), dtype=working_dtype).element_size()
    dtype = _dtype_name(working_bytes)
    optimizer = estimator_optimizer(config.optimizer)
    bf16 = config.bf16
    master_dtype = "bf16" if bf16.enabled and bf16.bf16_master_weights_and_grads else "fp32"
    state_dtype = "bf16" if bf16.enabled and bf16.bf16_optimizer_states else "fp32"
    states = estimate(
        sizes,
        stage=zero.stage,
        num_gpus_per_node=comm.world_size,
        offload_optimizer=True,
        offload_param=zero.offload_param.enabled,
        dtype=dtype,
        reduce_bucket_size=zero.reduce_bucket_size,
    )
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # memory held by others (and our own context) is not ours to plan with; our allocator's is
        capacity = free + torch.cuda.memory_reserved(device)
        capacity = min(capacity, total)
    else:  # a CPU "device" shares the host's memory: the host is the only budget
        capacity = 0
    shard = math.ceil(trainable / comm.world_size) if zero.stage >= 1 else trainable
    micro = config.train_micro_batch_size_per_gpu or 1
    return AutoFacts(
        shard_numel=shard,
        fixed_device_bytes=states.gpu.params + states.gpu.grads + states.gpu_transient,
        device_capacity=capacity,
        host_available=host_available_bytes(),
        activations=guess_activations(model, micro, working_bytes, capacity),
        working_bytes=working_bytes,
        master_bytes=DTYPE_BYTES[master_dtype],
        moment_bytes=moment_bytes(sizes, optimizer, state_dtype),
        landing_bytes=host_landing_bytes(optimizer, dtype, master_dtype),
        weights_on_device=not (zero.stage == 3 and zero.offload_param.enabled),
    )


def estimator_optimizer(optimizer: OptimizerConfig | None) -> str:
    """The estimator's name (`OPTIMIZER_BYTES`) for the config's `optimizer` section: Muon, Lamb and SGD
    (with or without momentum) by their state, everything else as Adam (a client optimizer too: the usual
    case, and the most state)."""
    name = optimizer.type.lower() if optimizer is not None else "adamw"
    if name == "sgd":
        return "sgd_momentum" if optimizer is not None and optimizer.params.get("momentum") else "sgd"
    return name if name in ("muon", "lamb") else "adamw"


def agree_on_ratio(choice: RatioChoice, comm: Comm, device: torch.device) -> RatioChoice:
    """The ratio every rank takes: the largest host share any rank needs (the split must be the same on all
    of them, and a rank whose device has less room decides for all)."""
    if comm.world_size == 1:
        return choice
    import torch.distributed as dist

    value = torch.tensor([choice.ratio], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=comm.group)
    agreed = float(value.item())
    if agreed == choice.ratio:
        return choice
    return RatioChoice(agreed, f"ratio {agreed:g}: another rank's device has less room ({choice.reason})")


def resolve_auto_ratio(
    model: nn.Module, config: Config, comm: Comm, device: torch.device, working_dtype: torch.dtype
) -> RatioChoice:
    """`"ratio": "auto"` for this engine: the choice every rank takes, with the reason to log."""
    if device.type != "cuda":
        return RatioChoice(
            1.0,
            "ratio 1: the training device is the CPU, whose memory is the host's: nothing is gained by "
            "keeping a share of the optimizer state apart",
        )
    choice = auto_ratio(read_auto_facts(model, config, comm, device, working_dtype))
    return agree_on_ratio(choice, comm, device)


def with_auto_ratio(
    config: Config, model: nn.Module, comm: Comm, device: torch.device, working_dtype: torch.dtype
) -> Config:
    """`config` with `"ratio": "auto"` replaced by the ratio chosen for this machine (logged once, with why);
    any other config as it is. A model that cannot fit raises ValueError naming both sides' numbers."""
    zero = config.zero_optimization
    offload = zero.offload_optimizer
    if offload.device == "none":
        return config
    if offload.ratio is not None:
        # a set share below 1 keeps state on the device: refuse one that cannot fit before allocating it
        if device.type == "cuda" and offload.ratio < 1.0:
            facts = read_auto_facts(model, config, comm, device, working_dtype)
            short = ratio_shortfall(facts, offload.ratio)
            if short is not None:
                raise ConfigError(RATIO_KEY, short)
        return config
    try:
        choice = resolve_auto_ratio(model, config, comm, device, working_dtype)
    except ValueError as exc:
        raise ConfigError(RATIO_KEY, f'"auto": {exc}') from None
    if comm.rank == 0:
        _log.info("offload: %s auto: %s", RATIO_KEY, choice.reason)
    offload = replace(offload, ratio=choice.ratio)
    return replace(config, zero_optimization=replace(zero, offload_optimizer=offload))
