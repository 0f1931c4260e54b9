"""Engines built without an optimizer (DeepSpeed's inference engine: TRL's reference model, Accelerate or
Lightning preparing a model for evaluation) hold the model's working weights and nothing else, on a real
2-rank gloo engine with bf16 (whose training masters would be fp32 copies):

- at ZeRO stages 0, 1 and 2 every rank holds the bf16 weights once (2 bytes a parameter, within the flat
  buffers' alignment), at stage 3 its shard (1 byte a parameter at 2 ranks): no master copies, no
  gradient buffers, no optimizer state (`engine.memory_breakdown()`), also at stage 3 with the trainer's
  `offload_optimizer` + `offload_param` sections (TRL copies them into the reference model's config), and
  with `offload_param` alone (ZeRO-Inference: the shards in host memory);
- every engine's forward gives the plain bf16 model's output, bit for bit, and a training checkpoint
  loaded into one at ZeRO-2 gives the trained model's;
- backward on an engine whose trainable parameters it would not reduce says so in one line;
- a training engine built over a model an inference engine shards at ZeRO-3 (TRL's precomputed reference
  pass over the policy) takes it over and trains as plain PyTorch does.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.dist import run_distributed

ROWS, WIDTH = 4, 64
OFFLOAD = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
CASES = {
    "stage0": {"stage": 0},
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage3": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "stage3_offload": {"stage": 3, "stage3_param_persistence_threshold": 0, **OFFLOAD},
    "stage3_offload_param": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "offload_param": {"device": "cpu"},  # alone: ZeRO-Inference
    },
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8))
    model[0].requires_grad_(False)  # a frozen part beside trainable ones (a PEFT base, a partly frozen model)
    return model


def _worker(rank: int, world_size: int, save_dir: str) -> dict:
    import runtime
    from runtime.errors import UserError

    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(7)).bfloat16()
    with torch.no_grad():
        want = _model().bfloat16()(x)
    out: dict = {}
    for name, zero in CASES.items():
        config = {"train_batch_size": ROWS, "bf16": {"enabled": True}, "zero_optimization": zero}
        engine, optimizer, _, _ = runtime.initialize(model=_model(), config=config)
        with torch.no_grad():
            got = engine(x)
        out[name] = {
            "optimizer": optimizer,
            "breakdown": engine.memory_breakdown(),
            "host_param_bytes": engine.zero.host_param_bytes(),
            "equal": torch.equal(got, want),
        }
        if name == "stage2":
            with pytest.raises(UserError) as error:
                engine.backward(engine(x).float().pow(2).mean())
            out["backward_error"] = (str(error.value), error.value.hint)
        engine.destroy()
    out["handover"] = _handover(x.float())
    out["loaded"] = _load(x.float(), save_dir)
    return out


def _load(x: torch.Tensor, save_dir: str) -> float:
    """A training checkpoint loaded into an inference engine at ZeRO-2 (Lightning's validate from a
    checkpoint): its unsharded weights are the trained ones on every rank."""
    import runtime

    config = {"train_batch_size": ROWS, "zero_optimization": {"stage": 2, "reduce_bucket_size": 4000}}
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    trained, _, _, _ = runtime.initialize(model=_model(), config={**config, "optimizer": sgd})
    trained.backward(trained(x).pow(2).mean())
    trained.step()
    trained.save_checkpoint(save_dir)
    engine, _, _, _ = runtime.initialize(model=_model(), config=config)
    engine.load_checkpoint(save_dir)
    with torch.no_grad():
        return (engine(x) - trained(x)).abs().max().item()


def _handover(x: torch.Tensor) -> dict:
    """TRL's precomputed reference pass (DPO's precompute_ref_log_probs without a reference model): an
    inference engine over the policy at ZeRO-3, then the Trainer's training engine over the same model."""
    import runtime

    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    config = {"train_batch_size": ROWS, "zero_optimization": zero}
    model = _model()
    reference, _, _, _ = runtime.initialize(model=model, config=config)
    with torch.no_grad():
        before = reference(x)
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    engine, _, _, _ = runtime.initialize(model=model, config={**config, "optimizer": sgd})
    handed = reference.memory_breakdown()  # its shards are stale copies now: freed
    engine.backward(engine(x).pow(2).mean())  # every rank the same rows: the mean gradient is theirs
    engine.step()
    plain = _model()
    with torch.no_grad():
        plain_before = plain(x)
    plain(x).pow(2).mean().backward()
    torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=0.1).step()
    with torch.no_grad():
        after, through_reference, want = engine(x), reference(x), plain(x)
    # the same at ZeRO-0/2 (TRL's reference engine below ZeRO-3 is a ZeRO-0 one): the copies it made go
    model = _model()
    zero = {"train_batch_size": ROWS, "zero_optimization": {"stage": 0}}
    frozen = sum(p.numel() for p in model[0].parameters())
    first, _, _, _ = runtime.initialize(model=model, config=zero)
    second, _, _, _ = runtime.initialize(
        model=model, config={"train_batch_size": ROWS, "zero_optimization": {"stage": 2}, "optimizer": sgd}
    )
    second.backward(second(x).pow(2).mean())
    second.step()
    with torch.no_grad():
        low = (second(x) - want).abs().max().item(), torch.equal(first(x), second(x))
    return {
        # what it still counts is the frozen layer the model holds (unmanaged by any engine), nothing else
        "low_stage": (*low, first.memory_breakdown().model_state_bytes - 4 * frozen),
        "before": (before - plain_before).abs().max().item(),
        "after": (after - want).abs().max().item(),
        "shared": torch.equal(through_reference, after),  # one model: the reference sees the new weights
        "handed_bytes": handed.model_state_bytes,
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("inference")), timeout=120)


@pytest.mark.filterwarnings("ignore")
def test_engines_without_an_optimizer_hold_only_the_working_weights(ranks: list[dict]) -> None:
    numel = sum(p.numel() for p in _model().parameters())
    for out in ranks:
        for name in CASES:
            case = out[name]
            memory = case["breakdown"]
            assert case["optimizer"] is None, name
            assert case["equal"], f"{name}: the forward differs from the plain bf16 model's"
            held = (memory.master_bytes, memory.grad_bytes, memory.optimizer_bytes, memory.host_buffer_bytes)
            assert held == (0, 0, 0, 0), (name, memory)
            per_param = 2 if name in ("stage0", "stage1", "stage2") else 1  # bf16; stage 3: half at 2 ranks
            assert per_param * numel <= memory.param_bytes <= per_param * numel * 1.02, (name, memory)
            assert memory.model_state_bytes == memory.param_bytes, (name, memory)
            offloaded = name.startswith("stage3_offload")
            assert case["host_param_bytes"] == (memory.param_bytes if offloaded else 0), (name, case)
            assert memory.host_bytes == case["host_param_bytes"], (name, memory)
        assert out["loaded"] == 0.0  # a checkpoint loads into the unsharded weights of every rank
        assert out["backward_error"] == (
            "engine.backward(): this ZeRO-2 engine was built without an optimizer (no optimizer= and no "
            '"optimizer" section), as an inference engine: it keeps no gradient buffers, so it reduces no '
            "gradients and updates nothing",
            'to train the model pass optimizer=... or add an "optimizer" section; run an inference engine\'s '
            "forward under torch.no_grad()",
        )


@pytest.mark.filterwarnings("ignore")
def test_a_training_engine_takes_the_model_over_from_an_inference_engine(ranks: list[dict]) -> None:
    """The second engine gathers the weights the first one sharded (its frozen layer whole, the rest in
    its own units) and trains as plain PyTorch does; the first engine's forward then reads the same
    (updated) model, as DeepSpeed's engines share their partitioned parameters, and its stale shards are
    freed."""
    for out in ranks:
        got = out["handover"]
        assert got["before"] <= 1e-6 and got["after"] <= 1e-6, got
        assert got["shared"] and got["handed_bytes"] == 0, got
        assert got["low_stage"][0] <= 1e-6 and got["low_stage"][1:] == (True, 0), got
