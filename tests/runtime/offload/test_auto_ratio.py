"""`"ratio": "auto"` (runtime/offload/auto_ratio.py): the share the engine picks from the model and the memory
both sides report, the reason it logs, and the refusal of a set ratio that cannot fit, word for word.

The choice is a pure function of `AutoFacts`, checked here with the H200's numbers for the 13.48B GPT the
benchmark trains (BENCHMARKS.md); the engine's wiring runs on the CPU (where "auto" keeps the whole state
on the host) and, in the `gpu` test, on a GPU with room for all of it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.logs import captured_log

GIB = 1 << 30
N13B = 13_477_662_720  # GPT 5120 x 42 layers
WEIGHTS_AND_GRADS = 4 * N13B  # bf16 weights and gradients, ZeRO-2, one rank


def _gpt(layers: int = 42, width: int = 5120, heads: int = 40):
    from runtime.models.gpt import GPT, GPTConfig

    with torch.device("meta"):  # the shape is all that is read
        return GPT(GPTConfig(n_layer=layers, n_head=heads, n_embd=width, max_seq_len=1024))


def _facts(**changes):
    from runtime.offload.auto_ratio import AutoFacts, guess_activations

    facts = {
        "shard_numel": N13B,
        "fixed_device_bytes": WEIGHTS_AND_GRADS,
        "device_capacity": int(139.5 * GIB),
        "host_available": int(124.8 * GIB),
        "activations": guess_activations(_gpt(), 1, 2, int(139.5 * GIB)),
        "working_bytes": 2,
    }
    return AutoFacts(**{**facts, **changes})


def test_auto_keeps_on_the_device_what_fits_beside_weights_gradients_and_activations() -> None:
    from runtime.offload.auto_ratio import auto_ratio

    choice = auto_ratio(_facts())
    # 139.5 GiB less 50.2 GiB of weights and gradients and 8.0 GiB of reserve leave 81.3 GiB: the state
    # (12 bytes an element) with the activations (7.5 GiB) in forward and backward, and with the step's
    # fp32 gradient copy and room for its allocation (8 bytes) after them: 32% of the state stays
    assert choice.ratio == 0.68
    assert choice.reason == (
        "ratio 0.68: the device keeps 32% of the optimizer state (48.2 GiB), what fits in the device's 89.3 "
        "GiB free, less a reserve of 8.0 GiB, beside the activations (7.5 GiB) in forward and backward and "
        "the step's buffers (32.1 GiB) after them; the host holds the rest (119.5 GiB of 122.8 GiB "
        "available); the device's 139.5 GiB also hold 50.2 GiB of weights and gradient buffers; "
        "activations: 7.5 GiB for micro batch 1 x 1024 tokens of a 42-layer model of width 5120 (every "
        "block's activations kept; sequence = the model's positions)"
    )
    # a smaller model fits on the device whole; a device with no room leaves it all to the host
    small = auto_ratio(_facts(shard_numel=1_000_000_000, fixed_device_bytes=4_000_000_000))
    assert small.ratio == 0.0 and small.reason.startswith("ratio 0: all of the optimizer state (11.2 GiB)")
    none = auto_ratio(_facts(device_capacity=60 * GIB, shard_numel=5_000_000_000))
    assert none.ratio == 1.0 and none.reason.startswith("ratio 1: no optimizer state fits on the device")


def test_auto_refuses_a_model_neither_side_can_hold_with_the_numbers() -> None:
    from runtime.offload.auto_ratio import auto_ratio

    with pytest.raises(ValueError) as caught:
        auto_ratio(_facts(shard_numel=20_000_000_000))
    assert str(caught.value) == (
        "the optimizer state of this rank's 20,000,000,000 elements does not fit: the device can hold "
        "4,365,662,126 of them (the device's 89.3 GiB free, less a reserve of 8.0 GiB, beside the "
        "activations (7.5 GiB) in forward and backward and the step's buffers (31.3 GiB) after them) and "
        "the host the rest only with 206.0 GiB, of 122.8 GiB available; both together hold about "
        "13,783,911,839 elements"
    )


def test_a_set_ratio_that_cannot_fit_is_refused_with_both_sides_and_what_auto_would_pick() -> None:
    from runtime.offload.auto_ratio import ratio_shortfall

    assert ratio_shortfall(_facts(), 0.68) is None  # what the benchmark trained
    assert ratio_shortfall(_facts(), 0.3) == (
        "0.3 cannot train this model's 13,477,662,720-element shard: the device needs 190.8 GiB for weights, "
        "gradients and its 70% of the optimizer state, before activations, and has 139.5 GiB; "
        '"auto" would choose 0.68'
    )
    assert ratio_shortfall(_facts(), 0.95) == (
        "0.95 cannot train this model's 13,477,662,720-element shard: the host needs 166.9 GiB for its 95% "
        'of the optimizer state and has 124.8 GiB available; "auto" would choose 0.68'
    )


def test_activations_are_estimated_from_the_models_shape_or_a_share_of_the_device() -> None:
    from runtime.activation_checkpointing import checkpoint
    from runtime.offload.auto_ratio import guess_activations, model_shape

    gpt = _gpt(layers=4, width=256, heads=4)
    assert model_shape(gpt) == {"width": 256, "layers": 4, "vocab": 50304, "positions": 1024}
    kept = guess_activations(gpt, 2, 2, 80 * GIB)
    gpt.checkpoint_fn = checkpoint
    recomputed = guess_activations(gpt, 2, 2, 80 * GIB)
    assert recomputed.nbytes < kept.nbytes
    assert "(checkpointed blocks;" in recomputed.source
    # a Hugging Face config says the same under other names; 128k positions are capped at 8192 a sample
    hf = torch.nn.Linear(2, 2)
    hf.config = SimpleNamespace(
        hidden_size=4096, num_hidden_layers=32, vocab_size=128256, max_position_embeddings=131072
    )
    hf.is_gradient_checkpointing = True
    guess = guess_activations(hf, 1, 2, 80 * GIB)
    assert guess.source.endswith("(checkpointed blocks; sequence = the model's positions, at most 8192)")
    assert guess.source.startswith("micro batch 1 x 8192 tokens", guess.source.index("GiB for ") + 8)
    # a model without a shape: a quarter of the device, and the advice to set a number
    plain = guess_activations(torch.nn.Linear(2, 2), 1, 2, 80 * GIB)
    assert plain.nbytes == 20 * GIB
    assert plain.source == (
        "20.0 GiB (25% of the device: the model does not say its width, depth and vocabulary in .config; set "
        "zero_optimization.offload_optimizer.ratio to a number to choose yourself)"
    )


def _auto_engine(rank: int, world_size: int, ratio: str | float) -> dict:
    import runtime
    from tests.support.models import loss_fn, make_model, rank_batch

    with captured_log("runtime.offload") as records:
        config = {
            "train_batch_size": 4 * world_size,
            "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": ratio}},
        }
        engine, *_ = runtime.initialize(model=make_model(0), config=config)
        losses = []
        for step in range(3):
            x, y = rank_batch(step, 0, 4 * world_size, rank, world_size)
            loss = loss_fn(engine(x.to(engine.device)), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        result = {
            "ratio": engine.config.zero_optimization.offload_optimizer.ratio,
            "placement": type(engine.masters).__name__,
            "losses": losses,
            "log": [m for m in records if "ratio auto" in m],
        }
        engine.destroy()
    return result


def test_auto_on_the_cpu_keeps_the_state_on_the_host_and_says_why() -> None:
    """On a CPU device both memories are one: "auto" is ratio 1, the run equals it, and rank 0 logs why."""
    auto = run_distributed(_auto_engine, 2, "auto")
    full = run_distributed(_auto_engine, 2, 1.0)
    assert [r["ratio"] for r in auto] == [1.0, 1.0]
    assert auto[0]["placement"] == "HostMasters"
    assert auto[0]["losses"] == full[0]["losses"]
    assert auto[0]["log"] == [
        "offload: zero_optimization.offload_optimizer.ratio auto: ratio 1: the training device is the CPU, "
        "whose memory is the host's: nothing is gained by keeping a share of the optimizer state apart"
    ]
    assert auto[1]["log"] == []  # once, from rank 0


@pytest.mark.gpu
def test_auto_on_a_gpu_with_room_keeps_the_whole_state_on_the_device() -> None:
    got = run_distributed(_auto_engine, 1, "auto", device="cuda")[0]
    assert got["ratio"] == 0.0 and got["placement"] == "DeviceMasters", got
    assert len(got["log"]) == 1 and "ratio 0: all of the optimizer state" in got["log"][0], got["log"]
    assert "the model does not say its width" in got["log"][0]  # the test net has no .config


@pytest.mark.parametrize("optimizer", ["AdamW", "Muon"])
@pytest.mark.parametrize("states", ["fp32", "bf16"])
def test_auto_counts_the_host_bytes_the_estimator_counts(optimizer: str, states: str) -> None:
    """The facts "auto" decides from, read from the config as the engine does: per element of the shard
    the host share costs what `ds_estimate` counts for the same optimizer and state precision (Muon: one
    momentum on the matrices, two moments on the rest; its gradients converted to fp32 beside fp32
    masters), and the device share its state without the master when the masters are bf16."""
    from runtime.comm import Comm
    from runtime.config import load_config
    from runtime.distributed import init_distributed
    from runtime.estimator import estimate, model_sizes
    from runtime.estimator.fit import gpt_sizes
    from runtime.offload.auto_ratio import read_auto_facts

    bf16 = {"enabled": True}
    if states == "bf16":
        bf16 |= {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
        bf16["stochastic_rounding"] = optimizer == "AdamW"  # Muon rounds to nearest
    config = load_config(
        {
            "train_micro_batch_size_per_gpu": 1,
            "bf16": bf16,
            "optimizer": {"type": optimizer, "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": "auto"}},
        },
        world_size=1,
    )
    model = _gpt(layers=2, width=64, heads=2)
    init_distributed()
    facts = read_auto_facts(model, config, Comm(), torch.device("cpu"), torch.bfloat16)
    sizes = model_sizes(model)
    n = sizes.total_params
    unpadded = type(sizes)(total_params=n, muon_params=sizes.muon_params)
    est = estimate(
        unpadded,
        stage=2,
        offload_optimizer=True,
        optimizer=optimizer.lower(),
        master_dtype=states,
        state_dtype=states,
    )
    assert facts.shard_numel == n
    assert facts.host_state_bytes * n == pytest.approx(est.host_per_rank.total, abs=1)
    assert gpt_sizes(model.config).muon_params == sizes.muon_params  # ds_estimate --largest's GPT count
    muon_share = sizes.muon_params / n  # the blocks' matrices: 98,304 of the 3,385,088 elements
    moments = (4 * muon_share + 8 * (1 - muon_share)) if optimizer == "Muon" else 8
    moments /= 2 if states == "bf16" else 1
    assert facts.moment_bytes == pytest.approx(moments)
    converts = optimizer == "Muon" and states == "fp32"  # bf16 gradients into fp32 for the host step
    assert facts.landing_bytes == 2 + (4 if converts else 0)
    assert facts.device_state_bytes == pytest.approx(moments + (4 if states == "fp32" else 0))


def test_with_offload_param_the_device_share_of_bf16_masters_costs_its_masters() -> None:
    """bf16 masters on the device are the working weights, except under ZeRO-3's offload_param, which keeps
    the weights in host memory: the device share then holds a bf16 copy of its masters beside the moments.
    Uncounted, "auto" put 44% of a 17.63B model's state on an 80 GB H100 at micro-batch 8 and its first
    forward ran out of memory with 0.69 GiB left; at 34% on the device it trained (BENCHMARKS.md)."""
    from runtime.comm import Comm
    from runtime.config import load_config
    from runtime.distributed import init_distributed
    from runtime.estimator.fit import Machine, Workload, fit_gpt
    from runtime.models.gpt import GPTConfig
    from runtime.offload.auto_ratio import read_auto_facts

    bf16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}

    def facts(zero: dict) -> Any:
        config = load_config(
            {
                "train_micro_batch_size_per_gpu": 1,
                "bf16": bf16,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": "auto"}, **zero},
            },
            world_size=1,
        )
        init_distributed()
        return read_auto_facts(
            _gpt(layers=2, width=64, heads=2), config, Comm(), torch.device("cpu"), torch.bfloat16
        )

    assert facts({"stage": 3}).device_state_bytes == 4  # bf16 moments; the master is the working weight
    assert facts({"stage": 3, "offload_param": {"device": "cpu"}}).device_state_bytes == 2 + 4
    # ds_estimate counts the same: the 17.63B GPT on an H100 needs more of its state on the host
    gib = 1 << 30
    h100 = Machine(gpu_bytes=int(79.1 * gib), host_bytes=int(124.9 * gib), gpus_per_node=1)
    gpt = GPTConfig(n_layer=28, n_head=56, n_embd=7168, vocab_size=50304, max_seq_len=1024)
    work = Workload(micro_batch=8, master_dtype="bf16", state_dtype="bf16")
    z3 = fit_gpt(gpt, h100, work, stage=3, offload_param=True, ratio="auto")
    assert z3.ratio is not None and z3.ratio >= 0.664, z3.reason  # the share on the host that trained
