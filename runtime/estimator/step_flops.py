"""What one training step of a Llama-shaped model costs in FLOPs at a sequence length, and so how long it
takes at a given rate: the arithmetic behind ``ds_estimate --longest_seq --tflops`` and the time limit of
scripts/bench/long_context.py.

Two counts, because they answer different questions:

- ``model_flops``: what MFU conventionally counts, 6 x parameters x T (forward and backward of every
  weight) + 6 x layers x hidden x T^2 (causal attention's score and value products: 4 x hidden x T^2 a
  layer for the full square, half of it under the causal mask, three times for forward and backward).
- ``step_flops``: what the GPU executes, the model FLOPs plus the recomputation the long-sequence parts
  add: activation checkpointing runs every decoder layer's forward once more in backward (2 x layer
  parameters x T + 2 x hidden x T^2 a layer), and the tiled MLP re-runs its MLP's forward once more again,
  tile by tile, for its own backward (2 x 3 x hidden x intermediate x T a layer). The tiled loss computes
  its gradient during the forward and recomputes nothing. Embedding lookups count as 6 x their parameters
  in the model FLOPs (the convention) and are not recomputed.

A step's time at a rate is its executed FLOPs over the rate; a rate measured at one length predicts the
time at another only as far as the kernels keep that rate (attention's share grows with T).
"""

from __future__ import annotations

from runtime.estimator.longest import LlamaShape, LongSequenceSetup

ALL_PARTS = LongSequenceSetup()  # the tiled MLP and loss and checkpointed layers, as the bench trains


def model_flops(shape: LlamaShape, seq: int) -> int:
    """FLOPs of one step at `seq` tokens (micro-batch 1) as MFU counts them: no recomputation."""
    attention = 6 * shape.num_hidden_layers * shape.hidden_size * seq * seq
    return 6 * shape.num_params() * seq + attention


def recompute_flops(shape: LlamaShape, seq: int, setup: LongSequenceSetup = ALL_PARTS) -> int:
    """FLOPs the long-sequence parts run again: one forward of every checkpointed decoder layer, and with
    the tiled MLP one more forward of each MLP."""
    layers, h = shape.num_hidden_layers, shape.hidden_size
    checkpointed = layers * (2 * shape.layer_params * seq + 2 * h * seq * seq)
    tiled = layers * 2 * 3 * h * shape.intermediate_size * seq if setup.tiled_mlp else 0
    return checkpointed + tiled


def step_flops(shape: LlamaShape, seq: int, setup: LongSequenceSetup = ALL_PARTS) -> int:
    """FLOPs the GPU executes in one step at `seq` tokens: the model's and the recomputation."""
    return model_flops(shape, seq) + recompute_flops(shape, seq, setup)


def step_seconds(flops: float, tflops: float) -> float:
    """Seconds `flops` take at `tflops` (10^12 FLOPs a second)."""
    if tflops <= 0:
        raise ValueError(f"a rate must be positive, got {tflops} TFLOP/s")
    return flops / (tflops * 1e12)
