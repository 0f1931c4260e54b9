"""Does a GPT train on a machine, and which is the largest that does: model states and the rest, both sides.

``model_states`` counts what ZeRO allocates; a run also needs activations, staging buffers, the CUDA
context and room for the allocator, and on the host the process itself. This module adds those terms
(each a named, documented constant or formula below, so a measurement that disagrees points at one term)
and answers two questions for a machine (GPU memory, host memory, GPUs per host):

- ``fit_gpt``: does this size train with this configuration, and how much room is left on each side?
  With partial optimizer offload (``offload_optimizer.ratio``: the share of the optimizer state on the
  host) it also gives the range of ratios that fit, and the one ``"ratio": "auto"`` would pick: the
  smallest host share whose GPU side fits (the GPU updates its share faster than the CPU, and the host is
  what runs out first for large models), or the reason none does.
- ``largest_gpt``: the largest of a list of sizes that fits, and what stops the next one.

Bytes per element of this rank's shard for the state that ``ratio`` moves (fp32 master + optimizer
state, e.g. 4 + 8 for Adam): on the GPU when kept there, plus the fp32 copy of 16-bit gradients the
device's step makes (16 for Adam in bf16); with offload, room for that copy's single allocation again
(FRAGMENTATION_BYTES: measured on the H200, runtime/offload/auto_ratio.py), the copy and its room only at
the step, where the activations are gone (the peak takes the larger); on the host when offloaded, plus
the gradient landing buffer when the CPU updates it (2 bytes for bf16 landing, none for the device step,
which streams state through the GPU: runtime/offload/plan.py).

Activations of one GPT block, per token of the micro-batch (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", 2022, with flash attention so no s x s score matrix is kept):
about 34 x n_embd bytes in 16-bit. With activation checkpointing every block keeps only its input
(2 x n_embd bytes a token) and one block's full activations exist at a time, during its recomputation.
The logits and the loss add vocab x (2 + 4 + 4) bytes a token (16-bit logits, their fp32 copy for the
loss, and its gradient): on top of every block's activations without checkpointing, and with it on top of
the kept inputs only, as the loss's backward ends before the first block recomputes (the larger of the
two phases counts). Measured: ZeRO-3 with offload_param at micro batch 8 x 1024, 17.63B on an H100, held
9.4 GiB beside its model states at the peak, where the sum of both phases counted 11.7 (the gathered
units and the embedding's gradient included).

These are estimates, not allocations: the fixed terms (context, allocator slack, process overhead) come
from measurements on the H200 machine and are kept here as named constants; BENCHMARKS.md records how
the prediction compares with ``scripts/bench/offload.py --find_max``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.estimator.model_states import (
    DTYPE_BYTES,
    MASTER_BYTES,
    ModelSizes,
    device_master_bytes,
    estimate,
    host_landing_bytes,
    moment_bytes,
)
from runtime.host_memory import HOST_HEADROOM, PIN_ROOM_BYTES_PER_PARAM
from runtime.models.gpt import GPTConfig

GIB = 1 << 30
CUDA_CONTEXT_BYTES = 1 * GIB  # the CUDA context, cuBLAS workspaces and NCCL buffers of one process
ALLOCATOR_SLACK = 0.05  # share of the GPU the caching allocator loses to fragmentation and rounding
DEVICE_STEP_STAGING_BYTES = 1 * GIB  # the device step's staging slots (runtime/offload/step/device_step.py)
HOST_PROCESS_BYTES = 4 * GIB  # one training process's own resident memory (torch, CUDA libraries)
ACTIVATION_BYTES_PER_TOKEN_PER_EMBD = 34  # one GPT block in 16-bit, flash attention (see above)
LOGIT_BYTES_PER_TOKEN_PER_VOCAB = 2 + 4 + 4
# with offload, per element of the device's share: room for its fp32 gradient copy again (the engine's
# "auto" ratio budgets the same; runtime/offload/auto_ratio.py says what was measured)
FRAGMENTATION_BYTES = 4


@dataclass(frozen=True)
class Machine:
    """Memory one training host offers."""

    gpu_bytes: int  # each GPU's memory
    host_bytes: int  # host memory the job may use (what the OS reports available), shared by its ranks
    gpus_per_node: int = 1


def allocator_capped(cap_bytes: int, host_bytes: int) -> Machine:
    """The machine a process sees whose CUDA caching allocator is capped at `cap_bytes`
    (``torch.cuda.set_per_process_memory_fraction``; scripts/bench/long_context.py --gpu_gib).

    The cap bounds what the allocator reserves; the CUDA context (``CUDA_CONTEXT_BYTES``) lives outside
    it, and the allocator's slack is a share of what the allocator holds, not of the physical GPU. The
    estimates check ``need <= gpu_bytes`` with ``need = allocations + CUDA_CONTEXT_BYTES + ALLOCATOR_SLACK
    x gpu_bytes``; the GPU size returned here makes that the same test as ``allocations + ALLOCATOR_SLACK x
    cap <= cap``: ``gpu_bytes = cap + CUDA_CONTEXT_BYTES / (1 - ALLOCATOR_SLACK)``."""
    if cap_bytes <= 0:
        raise ValueError(f"an allocator cap must be positive, got {cap_bytes} bytes")
    return Machine(
        gpu_bytes=cap_bytes + math.ceil(CUDA_CONTEXT_BYTES / (1 - ALLOCATOR_SLACK)), host_bytes=host_bytes
    )


@dataclass(frozen=True)
class Workload:
    """What a step processes."""

    seq_len: int = 1024
    micro_batch: int = 1
    activation_checkpointing: bool = True
    dtype: str = "bf16"  # working weights and activations
    optimizer: str = "adam"
    master_dtype: str = "fp32"  # "bf16": bf16.bf16_master_weights_and_grads
    state_dtype: str = "fp32"  # "bf16": bf16.bf16_optimizer_states


@dataclass(frozen=True)
class Fit:
    """The verdict for one size and configuration; bytes are per GPU and per host."""

    params: int
    fits: bool
    ratio: float | None  # the offload ratio the verdict is for (None: no optimizer offload)
    ratio_range: tuple[float, float] | None  # the ratios that fit (None: none does, or no offload)
    gpu_need: int
    host_need: int
    gpu_bytes: int
    host_bytes: int
    reason: str

    @property
    def gpu_free(self) -> int:
        return self.gpu_bytes - self.gpu_need

    @property
    def host_free(self) -> int:
        return self.host_bytes - self.host_need


def activation_bytes(config: GPTConfig, work: Workload) -> int:
    """Peak activation memory of one micro-batch's forward and backward (see the module docstring)."""
    tokens = work.seq_len * work.micro_batch
    w = DTYPE_BYTES[work.dtype]
    block = ACTIVATION_BYTES_PER_TOKEN_PER_EMBD * config.n_embd * tokens * w // 2
    logits = tokens * config.vocab_size * LOGIT_BYTES_PER_TOKEN_PER_VOCAB
    if work.activation_checkpointing:
        # every block's input all along; the loss's logits, then one block's recomputation at a time:
        # backward runs the loss's first and frees its logits before any block recomputes
        return config.n_layer * tokens * config.n_embd * w + max(block, logits)
    return config.n_layer * block + logits


def gpt_sizes(config: GPTConfig) -> ModelSizes:
    """The sizes the estimate needs, from a runtime.models.gpt config (nothing is allocated)."""
    d = config.n_embd
    b = 1 if config.bias else 0
    # stage 3's gather units (runtime.zero.stage3_plan): a block whole (attention, MLP, two norms), and
    # the token embedding (the tied head's weight)
    block = 12 * d * d + b * 9 * d + 4 * d
    # AutoTP's share (GPT-2 layout): the q|k|v, attention-out and both MLP weights, and the colwise biases
    sharded = config.n_layer * (12 * d * d + b * 7 * d)
    # Muon's (runtime.optim.muon_split): the same four matrices of every block; embeddings and the tied
    # head stay on AdamW
    muon = config.n_layer * 12 * d * d
    return ModelSizes(
        total_params=config.num_params(),
        largest_layer_params=max(block, config.vocab_size * d),
        largest_param=max(4 * d * d, config.vocab_size * d),  # an MLP matrix, or the token embedding
        tensor_parallel_params=sharded,
        muon_params=muon,
    )


def fit_gpt(
    config: GPTConfig,
    machine: Machine,
    work: Workload = Workload(),
    *,
    stage: int = 2,
    offload_optimizer: bool = True,
    offload_param: bool = False,
    ratio: float | str = 1.0,
    host_step: bool | None = None,
) -> Fit:
    """Whether `config` trains on `machine` (one rank per GPU). `ratio`: the optimizer state's host share
    with offload (DeepSpeed's `offload_optimizer.ratio`), or "auto" for the smallest host share that fits
    the GPU. `host_step`: the CPU updates the host share (gradients land there: 2 more host bytes an element
    in 16-bit) instead of the GPU's streamed device step; None: where the engine would put it
    (`step_on_host`)."""
    w = DTYPE_BYTES[work.dtype]
    ranks = machine.gpus_per_node
    states = estimate(
        gpt_sizes(config),
        stage=stage,
        num_gpus_per_node=ranks,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        dtype=work.dtype,
        optimizer=work.optimizer,
        master_dtype=work.master_dtype,
        state_dtype=work.state_dtype,
    )
    params = config.num_params()
    shard = math.ceil(params / ranks) if stage >= 1 else params
    # bf16 masters: on the device mostly the working weights (`device_master_bytes`; no fp32 gradient copy
    # at the step: runtime.precision.master_adam), on the host 2 bytes; bf16 states: half the optimizer's.
    # Muon: its momentum on the blocks' matrices, AdamW's moments on the rest (gpt_sizes).
    bf16_masters = work.master_dtype == "bf16"
    moments = moment_bytes(gpt_sizes(config), work.optimizer, work.state_dtype)
    master = DTYPE_BYTES[work.master_dtype]
    host_movable = round(shard * (master + moments))  # what ratio moves, per rank
    weights_on_device = not (stage == 3 and offload_param)
    movable = round(shard * (device_master_bytes(master, weights_on_device=weights_on_device) + moments))
    # on the device the step also makes an fp32 copy of 16-bit gradients (runtime.precision.mixed)
    copies = w < MASTER_BYTES and not bf16_masters
    device_movable = movable + (shard * MASTER_BYTES if copies else 0)
    site = ""
    if host_step is None and offload_optimizer:
        host = machine.host_bytes
        why = step_on_host(work, offload_param=offload_param, shard=shard, ranks=ranks, host=host)
        host_step, site = why is not None, f" (the CPU runs the step: {why})" if why else ""
    landing = shard * host_landing_bytes(work.optimizer, work.dtype, work.master_dtype) if host_step else 0
    # the GPU without any of the movable state: weights, gradients, buckets, activations, fixed costs
    gpu_fixed = (
        states.gpu.params
        + states.gpu.grads
        + states.gpu_transient
        + activation_bytes(config, work)
        + CUDA_CONTEXT_BYTES
        + int(ALLOCATOR_SLACK * machine.gpu_bytes)
    )
    host_fixed = ranks * (HOST_PROCESS_BYTES + states.host_per_rank.params)
    host_init = ranks * states.host_init_per_rank  # the fp32 model built on the host first
    if not offload_optimizer:
        gpu_need = gpu_fixed + device_movable
        host_need = max(host_fixed, host_init + ranks * HOST_PROCESS_BYTES)
        return _verdict(params, None, None, gpu_need, host_need, machine)
    gpu_fixed += 0 if host_step else DEVICE_STEP_STAGING_BYTES
    # The device's share costs its state all the time, and at the step, once backward has freed the
    # activations, the fp32 gradient copy and room for that copy's single allocation again
    # (FRAGMENTATION_BYTES; runtime/offload/auto_ratio.py): the activations and the step's buffers take
    # turns, so the peak has the larger of the two.
    activations = activation_bytes(config, work)
    base = gpu_fixed - activations
    state = movable  # the share's state at ratio 0
    at_step = device_movable - movable + (shard * FRAGMENTATION_BYTES if copies else 0)

    def gpu_need_at(r: float) -> int:
        kept = 1.0 - r
        return base + math.floor(kept * state) + max(activations, math.floor(kept * at_step))

    per_host_share = ranks * (host_movable + landing)  # host bytes at ratio 1
    # GPU: gpu_need_at(r) <= gpu, both terms of its max; host: host_fixed + r * per_host_share <= host
    room = machine.gpu_bytes - base
    lows = [1.0 - (room - activations) / state if state else 0.0]
    if state + at_step:
        lows.append(1.0 - room / (state + at_step))
    low = max(lows)
    high = (machine.host_bytes - host_fixed) / per_host_share if per_host_share else 1.0
    low, high = max(low, 0.0), min(high, 1.0)
    window = (low, high) if low <= high else None
    # "auto": the GPU keeps as much of the state as fits beside everything else (its 5% slack included)
    chosen = min(low, 1.0) if ratio == "auto" else float(ratio)
    gpu_need = gpu_need_at(chosen)
    host_need = max(host_fixed + math.ceil(chosen * per_host_share), host_init + ranks * HOST_PROCESS_BYTES)
    return _verdict(params, chosen, window, gpu_need, host_need, machine, site)


def step_on_host(work: Workload, *, offload_param: bool, shard: int, ranks: int, host: int) -> str | None:
    """Why the engine runs the offloaded Adam step on the CPU rather than streaming the state through the
    GPU, or None where it streams it: the automatic choice of runtime/offload/plan.plan_update, on the facts
    known before a run (a GPU is assumed, and pinned memory). Keep the two in step: the estimator may not
    import the offload (it sits below it), so the rule is written twice and the room from host_memory."""
    if offload_param:
        return "offload_param keeps the working weights in host memory"
    if work.master_dtype == "bf16":
        return "bf16 master weights have their own Adam step"
    if work.optimizer not in ("adam", "adamw"):
        return f"the device step is Adam's, not {work.optimizer}'s"
    need = (shard * PIN_ROOM_BYTES_PER_PARAM + HOST_HEADROOM) * ranks
    if host < need:
        return (
            f"the device step pins {need / GIB:.1f} GiB of host memory, more than the {host / GIB:.1f} GiB "
            "here"
        )
    return None


def _verdict(
    params: int,
    ratio: float | None,
    window: tuple[float, float] | None,
    gpu_need: int,
    host_need: int,
    machine: Machine,
    site: str = "",
) -> Fit:
    short = []
    if gpu_need > machine.gpu_bytes:
        short.append(f"the GPU needs {gpu_need / GIB:.1f} GiB of {machine.gpu_bytes / GIB:.1f} GiB")
    if host_need > machine.host_bytes:
        short.append(f"the host needs {host_need / GIB:.1f} GiB of {machine.host_bytes / GIB:.1f} GiB")
    at = "" if ratio is None else f" at offload ratio {ratio:.2f}"
    if short:
        hint = ""
        if window is not None and ratio is not None and not window[0] <= ratio <= window[1]:
            hint = f"; ratios from {window[0]:.3f} to {window[1]:.3f} fit"
        elif ratio is not None and window is None:
            hint = "; no offload ratio fits both sides"
        reason = f"{params / 1e9:.2f}B parameters do not fit{at}: " + " and ".join(short) + hint
    else:
        reason = (
            f"{params / 1e9:.2f}B parameters fit{at}: GPU {gpu_need / GIB:.1f} of "
            f"{machine.gpu_bytes / GIB:.1f} GiB, host {host_need / GIB:.1f} of "
            f"{machine.host_bytes / GIB:.1f} GiB"
        )
    return Fit(
        params=params,
        fits=not short,
        ratio=ratio,
        ratio_range=window,
        gpu_need=gpu_need,
        host_need=host_need,
        gpu_bytes=machine.gpu_bytes,
        host_bytes=machine.host_bytes,
        reason=reason + site,
    )


def largest_gpt(
    configs: Sequence[GPTConfig], machine: Machine, work: Workload = Workload(), **options: object
) -> tuple[Fit | None, Fit | None]:
    """(the largest of `configs` that fits, the smallest that does not), by parameter count; `options` go
    to `fit_gpt`. Either is None when every size fits, or none does."""
    fits = sorted((fit_gpt(c, machine, work, **options) for c in configs), key=lambda f: f.params)  # type: ignore[arg-type]
    best = next((f for f in reversed(fits) if f.fits), None)
    too_big = next((f for f in fits if not f.fits and (best is None or f.params > best.params)), None)
    return best, too_big
