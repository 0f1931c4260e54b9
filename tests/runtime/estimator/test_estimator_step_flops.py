"""A long-sequence training step's FLOPs and time (runtime.estimator.step_flops), and the GPU an allocator
cap leaves (``allocator_capped``): hand arithmetic, the issue-34 figures, ``ds_estimate`` printing both."""

from __future__ import annotations

import json

import pytest

from runtime.estimator import main
from runtime.estimator.fit import ALLOCATOR_SLACK, CUDA_CONTEXT_BYTES, GIB, Machine, allocator_capped
from runtime.estimator.longest import LLAMA_SHAPES, LlamaShape, LongSequenceSetup, longest_sequence, memory_at
from runtime.estimator.step_flops import model_flops, recompute_flops, step_flops, step_seconds

TINY = LlamaShape(64, 128, 2, 4, 2, 100)  # hidden, intermediate, layers, heads, kv heads, vocab
LLAMA_8B = LLAMA_SHAPES["8b"]


def test_tiny_model_by_hand() -> None:
    h, i, kv, layers, vocab, seq = 64, 128, 32, 2, 100, 1000
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    params = layers * layer + 2 * vocab * h + h  # untied embedding and head, the final norm
    assert TINY.layer_params == layer and TINY.num_params() == params
    model = 6 * params * seq + 6 * layers * h * seq * seq
    assert model_flops(TINY, seq) == model
    checkpointed = layers * (2 * layer * seq + 2 * h * seq * seq)  # every layer's forward once more
    tiled = layers * 6 * h * i * seq  # and the MLP's forward a third time, in the tiles' backward
    assert step_flops(TINY, seq) == model + checkpointed + tiled
    assert recompute_flops(TINY, seq, LongSequenceSetup(tiled_mlp=False)) == checkpointed
    assert step_seconds(2e15, 500) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="positive"):
        step_seconds(1e12, 0)


def test_the_issue_34_step_at_500k_tokens_takes_about_ten_minutes() -> None:
    # issue 34's arithmetic: ~2.9e17 FLOPs a step for the 8B shape at 500K tokens, ~10 minutes at 500 TFLOP/s:
    # a length no 10-minute device command can walk to
    flops = step_flops(LLAMA_8B, 500_000)
    assert 2.9e17 <= flops <= 3.0e17
    assert 9 * 60 < step_seconds(flops, 500) < 10 * 60
    # attention is most of it: three quarters of the model FLOPs at that length
    attention = 6 * 32 * 4096 * 500_000**2
    assert attention / model_flops(LLAMA_8B, 500_000) > 0.75


def test_a_capped_allocator_is_the_cap_plus_the_context_outside_it() -> None:
    cap = 48 * GIB
    machine = allocator_capped(cap, 100 * GIB)
    assert machine.host_bytes == 100 * GIB
    # the estimator's test (need <= gpu_bytes, with the context and a slack share of gpu_bytes in need)
    # reduces to: allocations + the slack share of the cap <= the cap
    allocations = machine.gpu_bytes - CUDA_CONTEXT_BYTES - int(ALLOCATOR_SLACK * machine.gpu_bytes)
    assert abs(allocations - (1 - ALLOCATOR_SLACK) * cap) < 2
    with pytest.raises(ValueError, match="positive"):
        allocator_capped(0, GIB)


def test_a_cap_moves_the_8b_limit_to_where_a_step_takes_seconds_and_the_gpu_binds() -> None:
    capped = allocator_capped(40 * GIB, 120 * GIB)
    found = longest_sequence(LLAMA_8B, capped)
    assert found.binds == "gpu"  # the host (120 GiB) still has room at that length
    assert 30_000 < found.seq_len < 40_000
    gpu, host = memory_at(LLAMA_8B, found.seq_len, LongSequenceSetup(), capped)
    assert gpu - CUDA_CONTEXT_BYTES <= 40 * GIB and host < 120 * GIB
    assert step_seconds(step_flops(LLAMA_8B, found.seq_len), 300) < 20  # a walk of a few tries fits
    # the full H200 with a 125 GiB host: the host binds first, with the layer inputs in host memory
    assert longest_sequence(LLAMA_8B, Machine(139 * GIB, 125 * GIB)).binds == "host"


def test_command_line_capped_gpu_and_step_time(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--longest_seq", "8b", "--stage", "3", "--gpu_cap", "40", "--host_memory", "120"]
    assert main([*argv, "--tflops", "450", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    found = longest_sequence(LLAMA_8B, allocator_capped(40 * GIB, 120 * GIB))
    assert shown["seq_len"] == found.seq_len and shown["binds"] == "gpu"
    assert shown["step_flops"] == step_flops(LLAMA_8B, found.seq_len)
    assert shown["step_s"] == round(step_seconds(shown["step_flops"], 450), 1)
    assert main(argv) == 0  # without --tflops the lines are the memory verdicts alone
    assert "FLOPs" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--gpu_memory", "139"])
    assert exited.value.code == 2
    assert "one of --gpu_memory, --gpu_cap" in capsys.readouterr().err
