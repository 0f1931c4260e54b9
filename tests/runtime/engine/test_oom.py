"""Out of GPU memory in a training step, explained (runtime/engine/oom.py): the message names the phase,
the step and the allocator's numbers beside the engine's own model states; the hint lists the settings
that lower the peak for this configuration; the error is still torch's OutOfMemoryError with torch's
opening words, so HF Trainer's auto_find_batch_size and Accelerate's find_executable_batch_size still
retry with a smaller batch. Device: CPU, where the model raises the out-of-memory error itself (a CPU run
cannot exhaust a GPU) and everything after it is the engine's real path, under dslaunch too; CUDA for the
`gpu` test, which asks the allocator for 16 TiB: torch's own error, with the card's figures.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import runtime
from runtime.engine.oom import DeviceMemoryError, OomFacts, describe
from runtime.errors import UserError
from tests.support.dist import free_port, run_distributed
from tests.support.paths import REPO

GIB = 1 << 30
TORCH_TEXT = (
    "CUDA out of memory. Tried to allocate 1.15 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
    "402.00 MiB is free. Of the allocated memory 74.80 GiB is allocated by PyTorch"
)


def test_one_gpu_offload_with_an_auto_ratio() -> None:
    """Issue 32's case: ZeRO-3 with offload_param at micro-batch 8, out of memory in backward."""
    facts = OomFacts(
        phase="backward", step=1, micro_step=1, accumulation=8, micro_batch=8, world_size=1, stage=3,
        asked=int(1.15 * GIB), allocated=int(74.8 * GIB), reserved=int(77.3 * GIB), capacity=int(79.19 * GIB),
        device_states=int(62.0 * GIB), device_optimizer=int(29.5 * GIB), offload_ratio=0.55,
        ratio_was_auto=True, checkpointing=True,
    )  # fmt: skip
    message, hint = describe(facts)
    assert message == (
        "CUDA out of memory. The backward of step 1 (micro-batch 1 of 8) asked for 1.15 GiB with 74.80 GiB "
        "allocated and 77.30 reserved of the card's 79.19; the engine's model states take 62.00 GiB of the "
        "device, activations and temporaries the other 12.80"
    )
    assert hint.startswith("lower the peak with, cheapest first: train_micro_batch_size_per_gpu 8 -> 4 with ")
    assert "gradient_accumulation_steps 8 -> 16 keeps the global batch" in hint
    assert 'offload_optimizer.ratio 0.55 ("auto" chose it): each 0.1 more on the host frees about 6.5' in hint
    assert "expandable_segments:True (2.50 GiB were reserved but not allocated" in hint
    assert "recompute activations" not in hint and "zero_optimization.stage" not in hint


def test_several_ranks_without_offload_are_told_about_offload_and_the_stage() -> None:
    facts = OomFacts(
        phase="step", step=7, micro_step=1, accumulation=1, micro_batch=1, world_size=4, stage=1,
        asked=None, allocated=int(70 * GIB), reserved=int(70.5 * GIB), capacity=int(80 * GIB),
        device_states=int(60 * GIB), device_optimizer=int(40 * GIB), offload_ratio=None,
    )  # fmt: skip
    message, hint = describe(facts)
    assert message.startswith("CUDA out of memory. The update of step 7 ran out with 70.00 GiB allocated")
    assert "train_micro_batch_size_per_gpu" not in hint  # one sample a micro-batch already
    assert "recompute activations in backward" in hint
    assert 'offload_optimizer {"device": "cpu"} moves the optimizer state (40.00 GiB here)' in hint
    assert "zero_optimization.stage 1 -> 2 shards more of the model states over the 4 ranks" in hint
    assert "expandable_segments" not in hint


class RunsOut(nn.Module):
    """A linear model whose forward runs out of memory at its `fail_at`-th call."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls, self.fail_at = 0, fail_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise torch.OutOfMemoryError(TORCH_TEXT)
        return self.linear(x).pow(2).mean()


def test_the_engine_says_which_micro_batch_ran_out_and_stays_retryable() -> None:
    from accelerate.utils.memory import should_reduce_batch_size

    torch.manual_seed(0)
    model = RunsOut(fail_at=4)  # step 2's second micro-batch
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "steps_per_print": 0,
    }
    engine, _, _, _ = runtime.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(4, 8)
    with pytest.raises(DeviceMemoryError) as raised:
        for _ in range(4):
            engine.backward(engine(x))
            engine.step()
    error = raised.value
    assert str(error).startswith("CUDA out of memory. The forward of step 2 (micro-batch 2 of 2) asked for")
    assert isinstance(error, torch.OutOfMemoryError) and isinstance(error, UserError)
    assert isinstance(error.__cause__, torch.OutOfMemoryError)  # torch's own message is kept behind it
    assert should_reduce_batch_size(error)  # Accelerate's (and the Trainer's) retry with a smaller batch
    assert "train_micro_batch_size_per_gpu 4 -> 2 with gradient_accumulation_steps 2 -> 4" in error.hint
    engine.destroy()


def test_under_dslaunch_it_is_one_line_a_hint_and_exit_code_2(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, runtime\n"
        "from tests.runtime.engine.test_oom import RunsOut\n"
        "model = RunsOut(fail_at=2)\n"
        "config = {'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'AdamW', 'params': {}}}\n"
        "engine, _, _, _ = runtime.initialize(model=model, config=config)\n"
        "for _ in range(2):\n"
        "    engine.backward(engine(torch.randn(2, 8)))\n"
        "    engine.step()\n"
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = f"{REPO}:{REPO / 'compat'}"
    launch = [sys.executable, "-m", "launcher.cli", "--num_gpus", "1", "--master_port", str(free_port())]
    done = subprocess.run(
        [*launch, str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    assert "rank 0 (local rank 0) on localhost exited with code 2: CUDA out of memory. The forward" in output
    assert "  hint: lower the peak with, cheapest first: train_micro_batch_size_per_gpu 2 -> 1" in output
    assert "Traceback" not in output


@pytest.mark.parametrize(("micro", "smaller", "accumulation"), [(6, 3, 4), (5, 1, 10), (3, 1, 6)])
def test_the_smaller_micro_batch_divides_it_so_the_global_batch_stays(
    micro: int, smaller: int, accumulation: int
) -> None:
    facts = OomFacts(
        phase="forward", step=1, micro_step=1, accumulation=2, micro_batch=micro, world_size=1, stage=0,
        asked=None, allocated=None, reserved=None, capacity=None, device_states=0, device_optimizer=0,
        offload_ratio=None,
    )  # fmt: skip
    hint = describe(facts)[1]
    assert f"{micro} -> {smaller} with gradient_accumulation_steps 2 -> {accumulation} keeps" in hint
    assert smaller * accumulation == micro * 2


class AsksTooMuch(nn.Module):
    """A linear model whose `fail_at`-th forward asks the GPU for 16 TiB: a real CUDA out-of-memory error."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.linear = nn.Linear(256, 256)
        self.calls, self.fail_at = 0, fail_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            torch.empty(1 << 42, device=x.device)
        return self.linear(x).pow(2).mean()


def _cuda_oom(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = AsksTooMuch(fail_at=4)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "steps_per_print": 0,
    }
    engine, _, _, _ = runtime.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(4, 256, device=engine.device, dtype=torch.bfloat16)
    error = None
    try:
        for _ in range(4):
            engine.backward(engine(x))
            engine.step()
    except DeviceMemoryError as caught:
        error = caught
    allocated = torch.cuda.memory_allocated(engine.device)
    capacity = torch.cuda.get_device_properties(engine.device).total_memory
    engine.backward(engine(x))  # the micro-batch again: nothing was left half-done
    engine.step()
    done = engine.global_steps
    engine.destroy()
    return {
        "message": str(error) if error else None,
        "cause_is_torch": isinstance(error.__cause__, torch.OutOfMemoryError) if error else False,
        "allocated_gib": allocated / GIB,
        "capacity_gib": capacity / GIB,
        "steps": done,
    }


@pytest.mark.gpu
def test_a_real_cuda_out_of_memory_is_explained_with_the_cards_numbers() -> None:
    """CUDA: torch's own error from the allocator, explained with the allocator's and the card's figures."""
    got = run_distributed(_cuda_oom, 1, timeout=240, device="cuda")[0]
    message = got["message"]
    assert message is not None and got["cause_is_torch"]
    assert message.startswith(
        "CUDA out of memory. The forward of step 2 (micro-batch 2 of 2) asked for 16384.00 GiB with "
    ), message
    assert f"of the card's {got['capacity_gib']:.2f}" in message, message
    assert "the engine's model states take 0.00 GiB of the device" in message  # 256 x 256: 0.4 MiB
    assert got["steps"] == 2  # the step that ran out was made again and trained
