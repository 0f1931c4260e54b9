"""The longest sequence a Llama-shaped model trains on one machine, with the long-sequence parts counted.

``ds_estimate --longest_seq 8b --stage 3 --gpu_memory 139 --host_memory 125`` answers with a token count
and what stops the next length. The model is given by its config numbers (``LlamaShape``); the parts of
runtime.sequence and runtime.activation_checkpointing change which terms grow with the sequence:

GPU: the peak of a step is the larger of two phases of its backward, which never overlap (w = bytes of the
working dtype, h = hidden size, kv = key/value width, I = intermediate size, per token of the sequence):

- in every phase, the checkpointed layer inputs: ``L x h x w``, or 2 x h x w with ``cpu_checkpointing``
  (the input being recomputed and the one prefetched; the rest are in host memory);
- one decoder layer's recomputation and backward, one layer at a time: attention with flash/SDPA kernels
  (no seq x seq scores) keeps its input, normed input, q, k, v, the attention output and its projection,
  and as many gradients, 2 x (5 h + 2 kv) elements in w bytes, plus RMSNorm's fp32 upcasts (2 x 4 h;
  none with ``lean_norms``, runtime.sequence.lean_norm, which keeps the 16-bit input counted already);
  the residual stream and its gradient (2 h w); the MLP untiled, gate/up/act/product and their gradients
  (8 I w), or tiled, its input gradient and the one it receives (2 h w), one tile of about h tokens
  (``mlp_tiles``) of 8 x I elements and the layer's weight gradients summed in fp32 (3 h I x 4);
- the loss and its backward: untiled, the logits (w), their fp32 copy and its gradient (4 + 4) per
  vocabulary entry, and the final hidden states and their gradient (2 h w); tiled, the final norm's input,
  output and their gradients (4 h w), one tile of logits (at most ``LOGITS_TILE_BYTES`` in fp32) about
  ``LOSS_TILE_COPIES`` times and the head's weight gradient summed in fp32 (vocab x h x 4).

A tied head's 16-bit gradient (vocab x h x w) lives through the whole backward: it is complete only when
the embedding's, the last, arrives. One GPU holds the whole model as its shard, so stage 3 gathers nothing.

Measured (BENCHMARKS.md, "Long sequences"; scripts/bench/long_context.py --memory_trace): the 1B shape
under a 32 GiB cap on an H100 peaked at 82.4 KiB a token in a layer's backward (this model: 84) above
6.4 GiB of fixed terms (this model: 7.0), from 131,072 to 277,504 tokens; the loss phase is far smaller
there. Before, the two phases were summed: 100 KiB a token and 12.0 GiB, an estimate 27% short. The
limit under that cap lies in [277,504, 285,696) and this model names 290,816, 1.8-4.8% long: although it
overcounts the allocated peak, the allocator's unusable cached memory there (3.5 GiB) exceeds the slack.

Host, per token: ``L x h x w`` with ``cpu_checkpointing`` (pinned, as the side-stream copies need; each
layer's input in power-of-two blocks at most 1/64 over its size, runtime.sequence.host_stash.pinned_pieces).

Fixed terms: the model states (``model_states.estimate``: stage, offload), the CUDA context, the
allocator's slack, the host process: the same named constants as ``fit``; with optimizer offload, the
device step's staging slots (``device_step_staging``): allocated when the engine is built, they hold GPU
memory through forward and backward, as many as 1/16 of the GPU's free memory then holds (4 to 16 slots
of 256 MiB), so on a large GPU up to 4 GiB.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from runtime.estimator.fit import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT_BYTES,
    GIB,
    HOST_PROCESS_BYTES,
    Machine,
    Workload,
    step_on_host,
)
from runtime.estimator.model_states import DTYPE_BYTES, ModelSizes, estimate
from runtime.sequence.host_stash import pinned_pieces
from runtime.sequence.tiles import LOGITS_TILE_BYTES, mlp_tiles

LOSS_TILE_COPIES = 3.5  # fp32 logits, their log-softmax, their gradient, and the 16-bit logits (half)
FP32 = 4
# runtime/offload/plan.py's slot rule (device_slots, staging_bytes), restated: runtime.offload imports the
# estimator, not the other way round; tests/runtime/estimator/test_estimator_longest.py checks they agree
SLOT_BYTES = 4 * (1 << 24) * FP32  # fp32 master, two moments and the gradient of a 16M-element chunk
MIN_SLOTS, MAX_SLOTS, SLOTS_SHARE_OF_FREE = 4, 16, 16


def device_step_staging(device_free: int) -> int:
    """GPU bytes of the offloaded device step's staging slots on a GPU with `device_free` bytes free when
    the engine is built."""
    slots = max(MIN_SLOTS, min(MAX_SLOTS, device_free // SLOTS_SHARE_OF_FREE // SLOT_BYTES))
    return slots * SLOT_BYTES


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-style decoder's config numbers (HF ``LlamaConfig`` names)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False

    @property
    def kv_size(self) -> int:
        return self.hidden_size // self.num_attention_heads * self.num_key_value_heads

    @property
    def layer_params(self) -> int:
        """One decoder layer's parameters: q, o, k, v, gate/up/down, two norms."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.kv_size
        return 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h

    def num_params(self) -> int:
        heads = 1 if self.tie_word_embeddings else 2
        h = self.hidden_size
        return self.num_hidden_layers * self.layer_params + heads * self.vocab_size * h + h

    def sizes(self) -> ModelSizes:
        largest = max(self.layer_params, self.vocab_size * self.hidden_size)
        return ModelSizes(total_params=self.num_params(), largest_layer_params=largest)


# Presets: the published configs' numbers (random weights are built from them; no download)
LLAMA_SHAPES = {
    "1b": LlamaShape(2048, 8192, 16, 32, 8, 128256, tie_word_embeddings=True),  # Llama-3.2-1B
    "8b": LlamaShape(4096, 14336, 32, 32, 8, 128256),  # Llama-3.1-8B
}


@dataclass(frozen=True)
class LongSequenceSetup:
    """Which long-sequence parts are on, and where the model states live."""

    tiled_mlp: bool = True
    tiled_loss: bool = True
    cpu_checkpointing: bool = True
    # runtime.sequence.lean_norm: the norms keep their 16-bit input, not fp32 copies. Off by default: HF's
    # norms are what a model has unless the user swaps them, and the limits checked within 5% are with
    # them; with lean norms this model errs short (the 1B on an H200: 68 KiB a token counted, 52.5 measured)
    lean_norms: bool = False
    dtype: str = "bf16"
    stage: int = 3
    offload_optimizer: bool = True
    offload_param: bool = False
    master_dtype: str = "fp32"  # "bf16": bf16.bf16_master_weights_and_grads
    state_dtype: str = "fp32"  # "bf16": bf16.bf16_optimizer_states


@dataclass(frozen=True)
class SequenceFit:
    seq_len: int
    gpu_need: int
    host_need: int
    reason: str  # for the longest: what stops the next length (GPU or host)
    binds: str = ""  # which side the next length overflows: "gpu", "host", "gpu+host" ("": the walk's bound)


def memory_at(shape: LlamaShape, seq: int, setup: LongSequenceSetup, machine: Machine) -> tuple[int, int]:
    """(GPU bytes, host bytes) one training step at sequence length `seq` (micro-batch 1) needs."""
    w = DTYPE_BYTES[setup.dtype]
    h, i, kv, layers = shape.hidden_size, shape.intermediate_size, shape.kv_size, shape.num_hidden_layers
    states = estimate(
        shape.sizes(),
        stage=setup.stage,
        offload_optimizer=setup.offload_optimizer,
        offload_param=setup.offload_param,
        dtype=setup.dtype,
        master_dtype=setup.master_dtype,
        state_dtype=setup.state_dtype,
    )
    kept_layers = 2 if setup.cpu_checkpointing else layers
    stash = kept_layers * h * w  # checkpointed layer inputs on the GPU, alive in every phase
    # the backward of one decoder layer (recomputed, then differentiated)
    layer_token = 2 * (5 * h + 2 * kv) * w  # attention's working set (the norms' inputs among it)
    if not setup.lean_norms:
        layer_token += 2 * h * FP32  # HF's norms keep an fp32 upcast of their input each
    layer_token += 2 * h * w  # the residual stream and its gradient
    layer_fixed = 0
    if setup.tiled_mlp:
        layer_token += 2 * h * w  # the MLP's input gradient and the one it receives (its input: the norm's)
        layer_fixed += min(seq, math.ceil(seq / mlp_tiles(seq, h))) * 8 * i * w
        layer_fixed += 3 * h * i * FP32 if w < FP32 else 0  # one layer's weight gradients summed in fp32
    else:
        layer_token += 8 * i * w
    # the loss and its backward, before any layer's
    if setup.tiled_loss:
        loss_token = 4 * h * w  # the final norm's input and output, and their gradients
        loss_fixed = int(min(seq * shape.vocab_size * FP32, LOGITS_TILE_BYTES) * LOSS_TILE_COPIES)
        loss_fixed += shape.vocab_size * h * FP32  # the head's weight gradient, summed over tiles in fp32
    else:
        loss_token, loss_fixed = 2 * h * w + shape.vocab_size * (w + FP32 + FP32), 0
    # a tied head's 16-bit gradient waits for the embedding's, the last of the backward: alive throughout
    fixed = shape.vocab_size * h * w if shape.tie_word_embeddings else 0
    activations = seq * stash + max(seq * layer_token + layer_fixed, seq * loss_token + loss_fixed)
    work = Workload(dtype=setup.dtype, master_dtype=setup.master_dtype, state_dtype=setup.state_dtype)
    numel = shape.num_params()  # one GPU: the whole model is this rank's shard
    host_bytes = machine.host_bytes
    on_host = step_on_host(work, offload_param=setup.offload_param, shard=numel, ranks=1, host=host_bytes)
    if setup.offload_optimizer and on_host is None:  # the device step's staging slots
        # free when the engine is built: the model states are on the GPU, the activations not yet
        fixed += device_step_staging(max(0, machine.gpu_bytes - CUDA_CONTEXT_BYTES - states.gpu.total))
    gpu = (
        states.gpu.total  # one GPU: stage 3 gathers nothing (its shard is the whole model), no transient
        + fixed
        + activations
        + CUDA_CONTEXT_BYTES
        + int(ALLOCATOR_SLACK * machine.gpu_bytes)
    )
    host_states = states.host_per_rank.total
    host = HOST_PROCESS_BYTES + max(host_states, states.host_init_per_rank)
    if setup.cpu_checkpointing:  # each layer's input in pinned blocks (at most 1/64 over its size)
        host += layers * sum(pinned_pieces(seq * h * w))
    return gpu, host


def longest_sequence(
    shape: LlamaShape, machine: Machine, setup: LongSequenceSetup = LongSequenceSetup(), multiple: int = 1024
) -> SequenceFit:
    """The longest sequence (a multiple of `multiple` tokens) whose step fits both sides of `machine`;
    ``seq_len`` 0 when not even `multiple` tokens fit. Both needs grow with the length, so a bisection."""

    def fits(seq: int) -> bool:
        gpu, host = memory_at(shape, seq, setup, machine)
        return gpu <= machine.gpu_bytes and host <= machine.host_bytes

    low, high = 0, 1
    while fits(high * multiple):
        low, high = high, high * 2
        if high > 1 << 24:  # 16M x multiple tokens: no real machine; stop the walk
            break
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * multiple) else (low, mid)
    seq = low * multiple
    gpu, host = memory_at(shape, seq, setup, machine)
    next_gpu, next_host = memory_at(shape, seq + multiple, setup, machine)
    stops, binds = [], []
    if next_gpu > machine.gpu_bytes:
        stops.append(f"the GPU ({next_gpu / GIB:.1f} of {machine.gpu_bytes / GIB:.1f} GiB)")
        binds.append("gpu")
    if next_host > machine.host_bytes:
        stops.append(f"the host ({next_host / GIB:.1f} of {machine.host_bytes / GIB:.1f} GiB)")
        binds.append("host")
    reason = (
        f"{seq} tokens fit: GPU {gpu / GIB:.1f} GiB, host {host / GIB:.1f} GiB; {seq + multiple} tokens "
        f"overflow " + " and ".join(stops or ["nothing (the walk's bound)"])
    )
    return SequenceFit(seq_len=seq, gpu_need=gpu, host_need=host, reason=reason, binds="+".join(binds))


def longest_over_settings(
    shape: LlamaShape, machine: Machine, base: LongSequenceSetup = LongSequenceSetup(), multiple: int = 1024
) -> tuple[SequenceFit, LongSequenceSetup]:
    """The longest sequence over the settings that trade one side's memory for the other's, and the setup
    that reaches it: where the Adam state lives and in which dtypes (fp32 offloaded, bf16 offloaded, bf16
    on the GPU), the layer inputs on the host or not, the lean norms on or not. `base` keeps the rest (the
    tiled parts, the stage, the working dtype). Ties go to the earlier, plainer setup."""
    states = (("fp32", True), ("bf16", True), ("bf16", False))  # (masters' and moments' dtype, offloaded)
    best: tuple[SequenceFit, LongSequenceSetup] | None = None
    for (dtype, offloaded), host_inputs, lean in itertools.product(states, (True, False), (False, True)):
        setup = replace(
            base,
            offload_optimizer=offloaded,
            offload_param=False,
            master_dtype=dtype,
            state_dtype=dtype,
            cpu_checkpointing=host_inputs,
            lean_norms=lean,
        )
        found = longest_sequence(shape, machine, setup, multiple)
        if best is None or found.seq_len > best[0].seq_len:
            best = (found, setup)
    assert best is not None
    return best
