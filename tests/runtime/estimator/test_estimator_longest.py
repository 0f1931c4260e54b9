"""``ds_estimate --longest_seq``: the per-token terms of runtime.estimator.longest, part by part, and the
longest sequence found is the edge of what fits."""

from __future__ import annotations

from dataclasses import replace

import pytest

from runtime.estimator import main
from runtime.estimator.fit import ALLOCATOR_SLACK, GIB, Machine
from runtime.estimator.longest import (
    LLAMA_SHAPES,
    LongSequenceSetup,
    device_step_staging,
    longest_over_settings,
    longest_sequence,
    memory_at,
)

H200 = Machine(gpu_bytes=139 * GIB, host_bytes=125 * GIB)
LLAMA_8B = LLAMA_SHAPES["8b"]


def _per_token(setup: LongSequenceSetup) -> tuple[float, float]:
    """GPU and host bytes one more token costs (lengths that are multiples of the hidden size, so the tiled
    MLP's tile stays exactly hidden_size tokens)."""
    h = LLAMA_8B.hidden_size
    gpu_a, host_a = memory_at(LLAMA_8B, 16 * h, setup, H200)
    gpu_b, host_b = memory_at(LLAMA_8B, 32 * h, setup, H200)
    return (gpu_b - gpu_a) / (16 * h), (host_b - host_a) / (16 * h)


def test_presets_have_the_published_parameter_counts() -> None:
    assert LLAMA_SHAPES["8b"].num_params() == 8_030_261_248  # Llama-3.1-8B
    assert LLAMA_SHAPES["1b"].num_params() == 1_235_814_400  # Llama-3.2-1B (tied embeddings)


def test_each_part_moves_its_own_term() -> None:
    """At long lengths a layer's backward is the larger phase, and its per-token terms are the slope; the
    untiled loss makes the loss phase the larger (its logits grow with the vocabulary)."""
    h, i, kv, layers, vocab = 4096, 14336, 1024, 32, 128256
    w = 2  # bf16
    layer = 2 * (5 * h + 2 * kv) * w + 2 * h * 4 + 2 * h * w  # attention working set, norms, residual
    everything = LongSequenceSetup()
    gpu, host = _per_token(everything)
    assert gpu == 2 * h * w + layer + 2 * h * w  # 2 kept inputs, the tiled MLP's gradients
    assert host == layers * h * w  # every layer's input, in pinned host memory
    gpu, host = _per_token(LongSequenceSetup(cpu_checkpointing=False))
    assert (gpu, host) == (layers * h * w + layer + 2 * h * w, 0)
    gpu, _ = _per_token(LongSequenceSetup(tiled_mlp=False))
    assert gpu == 2 * h * w + layer + 8 * i * w  # gate, up, act, product and their gradients
    gpu, _ = _per_token(LongSequenceSetup(tiled_loss=False))
    assert gpu == 2 * h * w + 2 * h * w + vocab * (w + 4 + 4)  # the loss phase: logits, fp32 copy, gradient
    gpu, _ = _per_token(LongSequenceSetup(lean_norms=True))
    assert gpu == 2 * h * w + layer - 2 * h * 4 + 2 * h * w  # the norms keep no fp32 upcast


def test_the_phases_do_not_add_up() -> None:
    """The loss's logits tiles and fp32 head gradient are gone before a layer's backward begins: where a
    layer's backward is the larger phase, a larger vocabulary costs only its states (bf16 weights and
    gradients of the two vocab x h matrices), not its loss-phase terms; a tied head adds its 16-bit
    gradient, alive through the whole backward."""
    h, long = LLAMA_8B.hidden_size, 64 * LLAMA_8B.hidden_size
    gpu, _ = memory_at(LLAMA_8B, long, LongSequenceSetup(), H200)
    wider = replace(LLAMA_8B, vocab_size=LLAMA_8B.vocab_size + 1024)
    assert memory_at(wider, long, LongSequenceSetup(), H200)[0] - gpu == 2 * 1024 * h * (2 + 2)
    tied = replace(LLAMA_8B, tie_word_embeddings=True)
    head_states = LLAMA_8B.vocab_size * h * (2 + 2)  # the untied head's bf16 weight and gradient
    assert (
        memory_at(tied, long, LongSequenceSetup(), H200)[0] - gpu == LLAMA_8B.vocab_size * h * 2 - head_states
    )


def test_longest_sequence_is_the_edge_and_names_what_stops_it() -> None:
    found = longest_sequence(LLAMA_8B, H200)
    assert found.seq_len % 1024 == 0 and found.seq_len > 0
    gpu, host = memory_at(LLAMA_8B, found.seq_len, LongSequenceSetup(), H200)
    assert gpu <= H200.gpu_bytes and host <= H200.host_bytes
    gpu, host = memory_at(LLAMA_8B, found.seq_len + 1024, LongSequenceSetup(), H200)
    assert gpu > H200.gpu_bytes or host > H200.host_bytes
    # 8B with its Adam state offloaded: the host fills first (checkpoints of 32 layers x 8 KiB a token)
    assert found.reason.endswith(f"overflow the host ({host / GIB:.1f} of 125.0 GiB)")
    # there, layer inputs kept on the GPU train longer; without the tiled MLP and loss, far shorter
    on_gpu = longest_sequence(LLAMA_8B, H200, LongSequenceSetup(cpu_checkpointing=False))
    plain = LongSequenceSetup(tiled_mlp=False, tiled_loss=False, cpu_checkpointing=False)
    assert on_gpu.seq_len > 3 * found.seq_len
    assert longest_sequence(LLAMA_8B, H200, plain).seq_len < on_gpu.seq_len / 3


def test_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--longest_seq", "1b", "--gpu_memory", "139", "--host_memory", "125"]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = longest_sequence(LLAMA_SHAPES["1b"], H200, LongSequenceSetup(stage=2))
    other = longest_sequence(LLAMA_SHAPES["1b"], H200, LongSequenceSetup(stage=2, cpu_checkpointing=False))
    assert lines[:2] == [expected.reason, f"without cpu_checkpointing: {other.reason}"]
    assert lines[0].startswith(f"{expected.seq_len} tokens fit")
    assert lines[2].startswith("longest over the settings: ")  # longer than both: the flags that get there
    with pytest.raises(SystemExit) as exited:
        main(["--longest_seq", "4096:1:2", "--gpu_memory", "139", "--host_memory", "125"])
    assert exited.value.code == 2
    assert "argument --longest_seq: expected 1b or 8b, or HIDDEN:INTERMEDIATE" in capsys.readouterr().err


def test_the_device_steps_staging_slots_are_counted_as_the_engine_sizes_them() -> None:
    from runtime.offload.plan import device_slots, staging_bytes

    for free_gib in (0, 8, 30, 50, 64, 70, 140):
        free = free_gib * GIB
        assert device_step_staging(free) == staging_bytes(None, device_slots(free)), free_gib
    # the estimate counts them: on the H200, 107 GiB free after the 8B shape's states, 16 slots, 4 GiB
    free = H200.gpu_bytes - GIB - 2 * 2 * LLAMA_8B.num_params()  # less the context, weights, gradients
    assert device_step_staging(free) == 4 * GIB
    # a 48 GiB GPU has 17 GiB free then: the fewest slots, 1 GiB; the needs differ by 3 GiB and the slack
    small = Machine(48 * GIB, 125 * GIB)
    big_need, small_need = (memory_at(LLAMA_8B, 65536, LongSequenceSetup(), m)[0] for m in (H200, small))
    slack = int(ALLOCATOR_SLACK * H200.gpu_bytes) - int(ALLOCATOR_SLACK * small.gpu_bytes)
    assert big_need - small_need == 3 * GIB + slack


def test_16_bit_masters_and_states_free_host_memory_and_the_staging_slots() -> None:
    # bf16 masters + states: 2 + 4 host bytes a parameter instead of 4 + 8, and the CPU runs their own
    # Adam step, so the device step's staging slots are not allocated (runtime/offload/host_masters.py)
    plain = LongSequenceSetup()
    half = LongSequenceSetup(master_dtype="bf16", state_dtype="bf16")
    gpu_plain, host_plain = memory_at(LLAMA_8B, 65536, plain, H200)
    gpu_half, host_half = memory_at(LLAMA_8B, 65536, half, H200)
    assert host_plain - host_half == 6 * LLAMA_8B.num_params()
    assert gpu_plain - gpu_half == 4 * GIB
    assert longest_sequence(LLAMA_8B, H200, half).seq_len > longest_sequence(LLAMA_8B, H200, plain).seq_len
    # a host too small to pin the fp32 state (16 bytes a parameter) makes the engine step on the CPU too
    pinless = Machine(gpu_bytes=H200.gpu_bytes, host_bytes=100 * GIB)
    assert memory_at(LLAMA_8B, 65536, plain, pinless)[0] == gpu_plain - 4 * GIB


def test_the_longest_over_the_settings_names_flags_that_ask_for_it(capsys: pytest.CaptureFixture) -> None:
    """The 8B shape on an H200: the host binds with the fp32 state offloaded (66K tokens), the GPU without
    host checkpoints (245K); the 16-bit state on the GPU, host checkpoints and lean norms reach 496K. The
    flags printed for it, given back to ds_estimate, ask for exactly that setup."""
    plain = longest_sequence(LLAMA_8B, H200, LongSequenceSetup())
    found, setup = longest_over_settings(LLAMA_8B, H200)
    on_gpu = longest_sequence(LLAMA_8B, H200, LongSequenceSetup(cpu_checkpointing=False))
    assert found.seq_len >= on_gpu.seq_len
    assert found.seq_len > 7 * plain.seq_len
    assert (setup.offload_optimizer, setup.master_dtype, setup.state_dtype) == (False, "bf16", "bf16")
    assert setup.cpu_checkpointing and setup.lean_norms
    machine = ["--gpu_memory", "139", "--host_memory", "125", "--stage", "3"]
    assert main(["--longest_seq", "8b", *machine]) == 0
    flags = capsys.readouterr().out.splitlines()[-1].split("tokens, with ")[1].split()
    assert main(["--longest_seq", "8b", *machine, *flags]) == 0
    assert capsys.readouterr().out.startswith(f"{found.seq_len} tokens fit")
