"""Two training engines over one model (TRL's DPO with precompute_ref_log_probs builds an engine over the
policy, then the Trainer builds its own over the same model), on a real 2-rank gloo job, fp32, SGD:

- the engine built second trains exactly as a fresh engine over a fresh copy of the model holding the
  same weights: its losses are equal, step by step, whatever the first engine's stage (the first
  engine's gradient hooks are gone: a stage-2 one took each `.grad` into its own buffers, a stage-3 one
  refused the new engine's backward, and a stage-1 engine's gradient views, still holding a backward's
  gradients, were added to a new stage-3 engine's first ones);
- a ZeRO 0-2 engine built over a model a ZeRO-3 engine shards gathers the full weights from that
  engine's units first (it raised ParamNotGathered before);
- a backward or step of the first engine says in one line that the model was taken over, naming both
  stages, and what to do.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.support.dist import run_distributed

ROWS, WIDTH, STEPS = 4, 16, 3
CASES = [(2, 1), (3, 3), (3, 1), (1, 3)]  # (the first engine's stage, the second's)
SGD = {"type": "SGD", "params": {"lr": 0.1}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def _config(stage: int) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 500}
    return {"train_batch_size": ROWS * 2, "zero_optimization": zero, "optimizer": SGD}


def _batch(step: int) -> torch.Tensor:  # every rank the same rows: the engine's mean gradient is plain's
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(step))


def _train(engine: Any) -> list[float]:  # runtime's engine (imported in the worker)
    losses = []
    for step in range(1, STEPS + 1):
        loss = engine(_batch(step)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _case(old_stage: int, new_stage: int) -> dict:
    import runtime
    from runtime.zero.takeover import ModelTakenOver

    model = _model()
    old, _, _, _ = runtime.initialize(model=model, config=_config(old_stage))
    old.backward(old(_batch(0)).pow(2).mean())
    old.step()
    old.backward(old(_batch(0)).pow(2).mean())  # gradients left in its buffers: the new engine ignores them
    new, _, _, _ = runtime.initialize(model=model, config=_config(new_stage))
    taken = _train(new)
    held = old.memory_breakdown().model_state_bytes  # its stale copies, freed at the take-over
    # the reference: a fresh copy of the model after the same first step, in a fresh engine
    plain = _model()
    plain(_batch(0)).pow(2).mean().backward()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    plain.zero_grad(set_to_none=True)  # a fresh model holds no gradient
    fresh, _, _, _ = runtime.initialize(model=plain, config=_config(new_stage))
    want = _train(fresh)
    errors = []
    for misuse in (lambda: old.backward(old(_batch(9)).pow(2).mean()), old.step):
        with pytest.raises(ModelTakenOver) as error:
            misuse()
        errors.append((str(error.value), error.value.hint))
    for engine in (old, new, fresh):
        engine.destroy()
    return {"taken": taken, "want": want, "errors": errors, "held": held}


def _worker(rank: int, world_size: int) -> dict:
    return {case: _case(*case) for case in CASES}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_worker, 2, timeout=120)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", CASES, ids=[f"zero{a}_then_zero{b}" for a, b in CASES])
def test_the_second_engine_trains_as_a_fresh_one_and_the_first_refuses(
    ranks: list[dict], case: tuple[int, int]
) -> None:
    old_stage, new_stage = case
    for out in ranks:
        got = out[case]
        assert got["taken"] == got["want"], got
        assert got["held"] == 0, got
        message = (
            f"of a ZeRO-{old_stage} engine whose model a ZeRO-{new_stage} engine built later over the same "
            "model took over (its gradient hooks and weight copies are gone)"
        )
        hint = "build one engine per model; keep using the newest engine (its forward, backward and step)"
        assert got["errors"] == [(f"backward {message}", hint), (f"step {message}", hint)]


ADAMW = {"type": "AdamW", "params": {"lr": 1e-3}}


def _released(old_stage: int, offload: bool, tmp: str) -> dict:
    import runtime
    from runtime.zero.takeover import ModelTakenOver

    config = _config(old_stage)
    config["optimizer"] = ADAMW
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    model = _model()
    old, _, _, _ = runtime.initialize(model=model, config=config)
    old.backward(old(_batch(0)).pow(2).mean())
    old.step()
    before = old.memory_breakdown()
    new, _, _, _ = runtime.initialize(model=model, config=_config(3))
    after = old.memory_breakdown()
    losses = _train(new)  # the new engine trains on, and the old one's forward still runs
    forward = old(_batch(1)).shape
    errors = []
    for misuse in (lambda: old.save_checkpoint(tmp), lambda: old.load_checkpoint(tmp), old.full_state_dict):
        with pytest.raises(ModelTakenOver) as error:
            misuse()
        errors.append(str(error.value).split(" of a ")[0])
    out = {
        "before": (before.optimizer_bytes, before.master_bytes, before.host_bytes + before.host_buffer_bytes),
        "after": (after.model_state_bytes, after.host_bytes + after.host_buffer_bytes),
        "masters": [p.numel() for g in old.optimizer.param_groups for p in g["params"]],
        "losses": losses,
        "forward": tuple(forward),
        "errors": errors,
    }
    for engine in (old, new):
        engine.destroy()
    return out


def _released_worker(rank: int, world_size: int, tmp: str) -> dict:
    return {(stage, offload): _released(stage, offload, tmp) for stage in (1, 2) for offload in (False, True)}


def test_the_first_engine_frees_its_optimizer_state_and_refuses_checkpoints(tmp_path: Any) -> None:
    """Device: CPU, 2 gloo ranks. A training engine (AdamW, with and without offload_optimizer) that a
    later engine took over frees its optimizer state, its masters and its offload buffers (TRL's two
    engines over one policy would otherwise hold two copies); its forward still runs, the new engine trains,
    and a checkpoint of it, which would hold nothing, is refused by name."""
    for out in run_distributed(_released_worker, 2, str(tmp_path), timeout=180):
        for (stage, offload), got in out.items():
            optimizer, masters, host = got["before"]
            assert optimizer > 0 and (masters > 0 or offload), (stage, offload, got)
            assert (host > 0) == offload, (stage, offload, got)
            assert got["after"] == (0, 0), (stage, offload, got)
            assert set(got["masters"]) == {0}, (stage, offload, got)
            assert got["forward"] == (ROWS, 4) and got["losses"][-1] < got["losses"][0], got
            assert got["errors"] == ["save_checkpoint", "load_checkpoint", "full_state_dict"], got
