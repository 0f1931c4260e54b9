"""One rank with 16-bit weights keeps autograd's own gradient tensors (runtime/zero/one_rank.py) by
default (`DSLAUNCH_AUTOGRAD_GRADS` unset or 1); 0 keeps the flat gradient buffer.

What a user relies on: the run trains exactly as it does with the flat gradient buffer, at
every ZeRO stage, in bf16 and fp16, with gradient accumulation, clipping, weight-decay groups, torch's step
and the fused one, and with a parameter that gets no gradient; after a step `.grad` is None, as after a
plain loop's `zero_grad()` and DeepSpeed's step; a `.grad` cleared between backward and step is refused as
the flat buffer refuses it, while one cleared before the backward is fine. On a GPU, a compiled run with
the fused step's CUDA kernel trains bit for bit as the flat buffer does.

Device: CPU (gloo, one rank) unless marked `gpu`.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.dist import run_distributed
from tests.support.models import UnevenNet, loss_fn, make_model, param_groups, rank_batch

AUTOGRAD = "DSLAUNCH_AUTOGRAD_GRADS"
FUSED = "DSLAUNCH_FUSED_MASTER_STEP"


def _config(precision: str, stage: int, clip: float) -> dict[str, Any]:
    extra = {"initial_scale_power": 8, "auto_cast": True} if precision == "fp16" else {}
    return {
        "train_batch_size": 8,
        "gradient_accumulation_steps": 2,
        precision: {"enabled": True, **extra},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
        "steps_per_print": 0,
    }


class WithUnused(nn.Module):
    """UnevenNet and a layer the forward never calls: its weight never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = UnevenNet()
        self.unused = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _train(rank: int, world_size: int, config: dict[str, Any], flat: bool, fused: bool, unused: bool) -> dict:
    import runtime

    os.environ[FUSED] = "1" if fused else "0"
    os.environ[AUTOGRAD] = "0" if flat else "1"
    try:
        model = WithUnused() if unused else make_model(0)
        engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
        losses, grads_after_step, distinct = [], [], True
        for step in range(4):
            for micro in range(2):
                x, y = rank_batch(step, micro, 8, rank, world_size)
                loss = loss_fn(engine(x), y)
                engine.backward(loss)
                grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
                storages = {g.untyped_storage().data_ptr() for g in grads}
                distinct = distinct and len(storages) == len(grads)
                engine.step()
                losses.append(loss.item())
            grads_after_step.append(sum(p.grad is not None for p in engine.module.parameters()))
        return {
            "stage": type(engine.zero).__name__,
            "losses": losses,
            "masters": [g.master.detach().clone() for g in engine.groups],
            "working": [p.detach().clone() for p in engine.module.parameters()],
            "grads_after_step": grads_after_step,
            "distinct_storages": distinct,
        }
    finally:
        os.environ.pop(AUTOGRAD, None), os.environ.pop(FUSED)


def _both(rank: int, world_size: int, config: dict[str, Any], fused: bool, unused: bool) -> dict:
    return {flat: _train(rank, world_size, config, flat, fused, unused) for flat in (False, True)}


CASES = [  # precision, stage, clip, fused step, a parameter without gradient
    ("bf16", 0, 0.0, True, False),
    ("bf16", 1, 1.0, False, True),
    ("bf16", 2, 0.5, True, True),
    ("bf16", 3, 0.0, False, False),
    ("fp16", 2, 1.0, True, False),
]


@pytest.mark.parametrize(("precision", "stage", "clip", "fused", "unused"), CASES, ids=str)
def test_trains_as_the_flat_buffer_does(
    precision: str, stage: int, clip: float, fused: bool, unused: bool
) -> None:
    """Device: CPU. Four steps of two micro-steps each: the same losses, masters and weights as with the
    flat buffer (bit for bit without clipping; with it the norm sums its parts in another order)."""
    [result] = run_distributed(_both, 1, _config(precision, stage, clip), fused, unused)
    own, flat = result[False], result[True]
    assert (own["stage"], flat["stage"]) == ("AutogradGradStage", "ReplicatedGradStage")
    assert own["distinct_storages"]  # each gradient is its own tensor, not a view of one buffer
    assert own["grads_after_step"] == [0] * 4  # cleared by the step, as torch's zero_grad() clears them
    tol = {"rtol": 0, "atol": 0} if clip == 0 else {"rtol": 1e-5, "atol": 1e-7}
    torch.testing.assert_close(own["losses"], flat["losses"], **tol)
    for a, b in zip(own["masters"], flat["masters"], strict=True):
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(own["working"], flat["working"], strict=True):
        torch.testing.assert_close(a, b, **tol)
    if unused:  # weight decay still moves the weight that never got a gradient, as in the flat buffer
        start = WithUnused().unused.weight.detach().to(own["working"][-2].dtype)
        assert not torch.equal(own["working"][-2], start)


def _cleared(rank: int, world_size: int, when: str) -> dict:
    import runtime

    os.environ[AUTOGRAD] = "1"
    model = make_model(0)
    config = _config("bf16", 2, 1.0)
    engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
    assert type(engine.zero).__name__ == "AutogradGradStage"
    losses = []
    try:
        for step in range(2):
            for micro in range(2):
                x, y = rank_batch(step, micro, 8, rank, world_size)
                if when == "before_backward" and micro == 0:
                    model.zero_grad()  # Lightning does this after initialize: nothing is lost
                loss = loss_fn(engine(x), y)
                engine.backward(loss)
                if when == "before_step" and micro == 1:
                    model.zero_grad()  # the accumulated gradients are gone
                engine.step()
                losses.append(loss.item())
    except Exception as exc:
        return {"error": (type(exc).__name__, str(exc))}
    return {"losses": losses}


def test_grad_cleared_outside_the_engine() -> None:
    """Device: CPU. `model.zero_grad()` before a backward changes nothing; between the backward and the
    step it is refused with what to do instead, before anything is updated."""
    [before], [between], [never] = (
        run_distributed(_cleared, 1, when) for when in ("before_backward", "before_step", "no")
    )
    assert before["losses"] == never["losses"]
    kind, message = between["error"]
    assert kind == "GradientViewsReplaced"
    assert "between the backward and the step" in message and "engine.zero_grad()" in message


def _compiled_masters(rank: int, world_size: int, flat: bool) -> list[torch.Tensor]:
    import runtime

    os.environ[AUTOGRAD] = "0" if flat else "1"
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(8)]).cuda()
    config = {"train_batch_size": 8, "bf16": {"enabled": True}, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}  # fmt: skip
    engine, *_ = runtime.initialize(model=model, config=config)
    engine.compile()
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        engine.backward(engine(x).float().square().mean())
        engine.step()
    os.environ.pop(AUTOGRAD, None)
    return [g.master.detach().cpu() for g in engine.groups]


@pytest.mark.gpu
def test_compiled_training_on_cuda_equals_the_flat_buffer() -> None:
    """Device: CUDA. Compiled (inductor), with the fused step's CUDA kernel run once a parameter instead of
    once a flat buffer: the masters after three steps are bit for bit the flat buffer's. (What it saves is
    the benchmark's to say: 5.98 GiB of peak and 6.7 ms of backward at a 3.2B Llama on an H100,
    BENCHMARKS.md.)"""
    [own] = run_distributed(_compiled_masters, 1, False, timeout=300, device="cuda")
    [flat] = run_distributed(_compiled_masters, 1, True, timeout=300, device="cuda")
    for a, b in zip(own, flat, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _stage_chosen(rank: int, world_size: int, config: dict[str, Any], env: str | None) -> str:
    import runtime

    if env is not None:
        os.environ[AUTOGRAD] = env
    try:
        model = make_model(0)
        engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
        return type(engine.zero).__name__
    finally:
        os.environ.pop(AUTOGRAD, None)


def _with(**extra: Any) -> dict[str, Any]:
    config = _config("bf16", 2, 0.0)
    config.pop("bf16")
    return {**config, **extra}


CHOICES = [  # world size, config, DSLAUNCH_AUTOGRAD_GRADS, the stage a user gets
    (1, _with(bf16={"enabled": True}), None, "AutogradGradStage"),  # the default
    (1, _with(bf16={"enabled": True}), "1", "AutogradGradStage"),
    (1, _with(bf16={"enabled": True}), "0", "ReplicatedGradStage"),
    (1, _with(), "1", "ReplicatedGradStage"),  # fp32: the weights are the masters, their .grad the buffer's
    (
        1,
        _with(bf16={"enabled": True}, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}),
        "1",
        "ReplicatedGradStage",
    ),  # the offload streams gradients out of the flat buffer
    (2, _with(bf16={"enabled": True}), "1", "ShardedGradStage"),
]


@pytest.mark.parametrize(("world", "config", "env", "expected"), CHOICES, ids=str)
def test_which_ranks_keep_autograd_gradients(
    world: int, config: dict, env: str | None, expected: str
) -> None:
    """Device: CPU. By default at one rank with 16-bit weights and the optimizer on the device; the flat
    buffer when asked for (0) and where something reads it (fp32 weights, an offloaded optimizer, two
    ranks)."""
    assert run_distributed(_stage_chosen, world, config, env) == [expected] * world
