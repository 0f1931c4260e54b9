"""Building the engine out of GPU memory (runtime/engine/setup_oom.py): the message gives the estimator's
model states for the configuration against the card, the hint the config changes that fit it, cheapest
first, with their GPU and host bytes; through runtime.initialize the error is torch's OutOfMemoryError and
a UserError. Device: CPU, where the model raises the error itself when the engine moves it (a CPU run
cannot exhaust a GPU); CUDA for the `gpu` test, whose allocator is capped below the model's size.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import runtime
from runtime.engine.oom import DeviceMemoryError
from runtime.engine.setup_oom import SetupFacts, describe_setup
from runtime.errors import UserError
from runtime.estimator.model_states import ModelSizes, estimate
from tests.support.dist import run_distributed

GIB = 1 << 30
H200 = int(139.8 * GIB)


def _facts(**changes: object) -> SetupFacts:
    base = SetupFacts(
        sizes=ModelSizes(total_params=20_000_000_000, largest_layer_params=617_000_000),
        world_size=1,
        stage=2,
        offload_optimizer=False,
        offload_param=False,
        dtype="bf16",
        master_dtype="fp32",
        state_dtype="fp32",
        optimizer="adamw",
        capacity=H200,
    )
    return SetupFacts(**{**base.__dict__, **changes})  # type: ignore[arg-type]


def test_a_20b_model_on_one_h200_is_told_which_offload_fits() -> None:
    facts = _facts()
    need = estimate(facts.sizes, stage=2, dtype="bf16").per_gpu_bytes
    message, hint = describe_setup(facts)
    assert message == (
        "CUDA out of memory while building the engine: ZeRO stage 2 on 1 rank keeps "
        f"{need / GIB:.2f} GiB of model states on each GPU by the estimate, on a card of 139.80 GiB"
    )
    assert hint.startswith("these fit the card by the estimate (15% of the card left for activations)")
    # 16-bit masters and moments kept on the card (8 bytes a parameter, 149 GiB) do not fit: the first
    # offer is the optimizer offload (the host's size unknown here)
    assert "cheapest change first: zero_optimization.offload_optimizer" in hint
    offload = estimate(facts.sizes, stage=2, dtype="bf16", offload_optimizer=True)
    assert (
        f'zero_optimization.offload_optimizer {{"device": "cpu"}} ({offload.per_gpu_bytes / GIB:.2f} GiB a '
        f"GPU, {offload.per_host_bytes / GIB:.2f} GiB of host)"
    ) in hint
    assert hint.index("offload_optimizer") < hint.index("offload_param")  # the cheaper change first
    assert hint.endswith("`ds_estimate` prints every configuration")


def test_several_ranks_at_stage_0_hear_of_16_bit_state_and_stage_3() -> None:
    facts = _facts(sizes=ModelSizes(3_000_000_000, 100_000_000), world_size=8, stage=0, capacity=20 * GIB)
    _, hint = describe_setup(facts)
    assert hint.startswith("these fit the card")
    assert "zero_optimization.stage 1 with bf16.bf16_master_weights_and_grads" in hint
    assert "zero_optimization.stage 3 (" in hint  # over 8 ranks, sharding alone fits


def test_with_the_hosts_125_gib_it_is_16_bit_state_split_by_an_auto_ratio() -> None:
    """Issue 32's 25B on one H200: neither side holds the offloaded 16-bit state whole, both together do."""
    _, hint = describe_setup(_facts(host=125 * GIB))
    assert hint.startswith(
        'zero_optimization.offload_optimizer {"device": "cpu"} and bf16.bf16_master_weights_and_grads and '
        'bf16.bf16_optimizer_states with "ratio": "auto": offloaded whole it needs 74.51 GiB of GPU and '
        "149.01 GiB of host; the ratio splits the optimizer state between the card (118.83 GiB usable) and "
        "the host (125.00 GiB available)"
    ), hint


def test_when_nothing_fits_it_names_the_least_and_what_it_needs() -> None:
    facts = _facts(sizes=ModelSizes(1_000_000_000_000, 50_000_000_000))  # a 100 GB layer gathered whole
    _, hint = describe_setup(facts)
    assert hint.startswith(
        "nothing fits the card: the least GPU is zero_optimization.stage 3 with offload_param"
    ), hint
    assert "more GPUs shard it" in hint


class MovesTooBig(nn.Module):
    """A model whose move to the engine's device runs out of memory (as a model too large for the card)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def, override]
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total ...")


def test_runtime_initialize_says_it_in_one_error_that_is_still_torchs() -> None:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "steps_per_print": 0,
    }
    model = MovesTooBig()
    with pytest.raises(DeviceMemoryError) as raised:
        runtime.initialize(model=model, model_parameters=model.parameters(), config=config)
    error = raised.value
    assert isinstance(error, torch.OutOfMemoryError) and isinstance(error, UserError)
    assert str(error).startswith("CUDA out of memory while building the engine: ZeRO stage 2 on 1 rank keeps")
    assert "on a card of" not in str(error)  # the CPU: no card to compare with
    assert error.hint.startswith(
        "by the estimate, cheapest change first: bf16.bf16_master_weights_and_grads and bf16.bf16_optimizer"
    )
    assert isinstance(error.__cause__, torch.OutOfMemoryError)


def _capped_setup(rank: int, world_size: int) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(GIB / 2 / total, device)  # half a GiB for this process
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(16)])  # 268M parameters: 1 GiB in fp32
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "steps_per_print": 0,
    }
    try:
        runtime.initialize(model=model, model_parameters=model.parameters(), config=config)
    except DeviceMemoryError as error:
        return {"message": str(error), "hint": error.hint, "total": total}
    return {"message": None}


@pytest.mark.gpu
def test_a_model_larger_than_the_allocator_allows_is_explained_on_cuda() -> None:
    got = run_distributed(_capped_setup, 1, timeout=240, device="cuda")[0]
    assert got["message"] is not None, "the engine was built in half a GiB"
    assert got["message"].startswith("CUDA out of memory while building the engine: ZeRO stage 1 on 1 rank")
    assert f"on a card of {got['total'] / GIB:.2f} GiB" in got["message"]
    assert "offload_optimizer" in got["hint"]
