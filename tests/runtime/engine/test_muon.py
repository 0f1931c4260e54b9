"""optimizer.type "Muon": torch.optim.Muon on the 2-D hidden weights and AdamW on the rest, on one process
and sharded by ZeRO 1-3 at world 2 (runtime/zero/muon_shards.py), with offload (whole, a ratio split,
offload_param) at every stage, checkpoints (also across bf16 and fp32 states), the state's bytes, and the
refusals.

The reference is a plain PyTorch run on the whole global batch with `torch.optim.Muon` over the same 2-D
weights and `torch.optim.AdamW` over the rest (`muon_split` is the rule the README documents).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from runtime.config import ConfigError
from runtime.optim import muon_split
from runtime.optim.muon import MuonSplitError
from tests.support.dist import run_distributed
from tests.support.models import global_batch, loss_fn, make_model, rank_batch

ROWS = 12
STEPS = 4
MUON = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.01, "adam_lr": 3e-3, "betas": [0.9, 0.99]}


def _config(stage: int, *, offload: bool = False, ratio: float = 1.0, params: bool = False) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": 700}  # several buckets: matrices over pieces
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "ratio": ratio}
    if params:
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_batch_size": ROWS,
        "steps_per_print": 0,
        "optimizer": {"type": "Muon", "params": dict(MUON)},
        "zero_optimization": zero,
    }


def _reference(steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """torch's Muon + AdamW over the global batches, on one intra-op thread as the ranks run (a BLAS call
    may block its sums differently with more threads, and the one-process test compares bit for bit)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_steps(steps)
    finally:
        torch.set_num_threads(threads)


def _reference_steps(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_model(0)
    split = muon_split(model)
    chosen = [n for n, p in model.named_parameters() if split[p]]
    assert chosen == ["inp.weight", "hidden.weight", "out.weight"]
    muon = torch.optim.Muon(
        [p for p in model.parameters() if split[p]],
        lr=MUON["lr"],
        momentum=MUON["momentum"],
        weight_decay=MUON["weight_decay"],
    )
    adam = torch.optim.AdamW(
        [p for p in model.parameters() if not split[p]],
        lr=MUON["adam_lr"],
        betas=tuple(MUON["betas"]),
        weight_decay=MUON["weight_decay"],
        fused=True,  # as the engine's on CPU (runtime.optim.adam_implementation)
    )
    losses = []
    for step in range(steps):
        x, y = global_batch(step, 0, ROWS)
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        muon.step()
        adam.step()
        muon.zero_grad()
        adam.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine(config: dict):
    import runtime

    engine, _, _, _ = runtime.initialize(model=make_model(0), config=config)
    return engine


def _train(engine, rank: int, world_size: int, steps: range) -> list[float]:
    import torch.distributed as dist

    losses = []
    for step in steps:
        x, y = rank_batch(step, 0, ROWS, rank, world_size)
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    out = torch.stack(losses)
    if world_size > 1:
        dist.all_reduce(out)
    return (out / world_size).tolist()


def _run(
    rank: int, world_size: int, stage: int, offload: bool, ratio: float = 1.0, params: bool = False
) -> dict:
    engine = _engine(_config(stage, offload=offload, ratio=ratio, params=params))
    losses = _train(engine, rank, world_size, range(STEPS))
    return {"losses": losses, "master": engine.full_state_dict()}


def _run_stages(rank: int, world_size: int, ckpt: str) -> dict:
    """Stages 1-3 at this world size (and stage 2 with offload_optimizer ratio 0.5), then save at step 2
    and resume into a fresh engine (stage 2)."""
    out = {stage: _run(rank, world_size, stage, False) for stage in (1, 2, 3)}
    # half the groups' state on the host, half on the device: each side steps only its own groups
    out["offload"] = _run(rank, world_size, 2, True, 0.5)
    out["offload1"] = _run(rank, world_size, 1, True)
    out["offload3"] = _run(rank, world_size, 3, True, params=True)  # the weights on the host too
    first = _engine(_config(2))
    _train(first, rank, world_size, range(2))
    first.save_checkpoint(ckpt, tag="two")
    straight = _train(first, rank, world_size, range(2, STEPS))
    resumed = _engine(_config(2))
    resumed.load_checkpoint(ckpt, tag="two")
    again = _train(resumed, rank, world_size, range(2, STEPS))
    out["resume"] = {
        "straight": straight,
        "again": again,
        "a": first.full_state_dict(),
        "b": resumed.full_state_dict(),
    }
    return out


def _resume_alone(rank: int, world_size: int, ckpt: str, stage: int) -> dict:
    """The world-2 checkpoint resumed by one process (the momentum shards joined), to the end."""
    engine = _engine(_config(stage))
    engine.load_checkpoint(ckpt, tag="two")
    return {"losses": _train(engine, rank, world_size, range(2, STEPS)), "master": engine.full_state_dict()}


def _assert_close(got: dict, want_losses: list[float], want: dict[str, torch.Tensor], tol: float) -> None:
    assert got["losses"] == pytest.approx(want_losses, rel=tol, abs=tol)
    for name, value in want.items():
        torch.testing.assert_close(got["master"][name], value, rtol=tol, atol=tol, msg=name)


ONE_PROCESS = ((0, False, 1.0, False), (2, True, 1.0, False), (1, True, 0.5, False), (3, True, 1.0, True))


def _run_each(rank: int, world_size: int, settings: tuple) -> list[dict]:
    return [_run(rank, world_size, *setting) for setting in settings]


def test_muon_on_one_process_equals_torch_muon_and_adamw() -> None:
    """World 1, stage 0 and offloaded stages 1-3 (stage 1 half on the host, stage 3 with the weights there
    too): the engine's weights equal torch.optim.Muon + AdamW's."""
    losses, master = _reference()
    for setting, got in zip(ONE_PROCESS, run_distributed(_run_each, 1, ONE_PROCESS)[0], strict=True):
        assert got["losses"] == losses, setting
        for name, value in master.items():
            assert torch.equal(got["master"][name], value), (setting, name)


def test_muon_across_zero_stages_at_world_2_and_resume(tmp_path) -> None:
    """Stages 1-3 at world 2 (matrices split over both ranks' shards; stage 2 half offloaded too) equal the
    one-process reference fed the same global batch; a resumed run continues exactly like the one that
    saved, and one process (stage 0) resumes the world-2 checkpoint to the same weights."""
    losses, master = _reference()
    rank0 = run_distributed(_run_stages, 2, str(tmp_path))[0]
    for stage in (1, 2, 3, "offload", "offload1", "offload3"):
        # the ranks' gradient sums round differently from the whole batch's (measured: 1.5e-8 apart)
        _assert_close(rank0[stage], losses, master, 1e-6)
    resume = rank0["resume"]
    assert resume["again"] == resume["straight"]
    for name, value in resume["a"].items():
        assert torch.equal(resume["b"][name], value), name
    alone = run_distributed(_resume_alone, 1, str(tmp_path), 0)[0]
    _assert_close(alone, resume["straight"], resume["a"], 1e-6)


def test_muon_state_is_one_buffer_for_muon_params_and_two_for_adam() -> None:
    """memory_breakdown's optimizer bytes: 4 per Muon parameter (momentum), 8 per AdamW one (+ its step
    count); ds_estimate's "muon" counts the same bytes from model_sizes' Muon share."""
    from runtime.estimator import estimate, model_sizes
    from runtime.estimator.model_states import ModelSizes

    measured = run_distributed(_state_bytes, 1)[0]
    model = make_model(0)
    split = muon_split(model)
    muon = sum(p.numel() for p in model.parameters() if split[p])
    adam = [p for p in model.parameters() if not split[p]]
    adam_numel = sum(p.numel() for p in adam)
    assert measured == 4 * muon + 8 * adam_numel + 4 * len(adam)
    sizes = model_sizes(model)
    assert sizes.muon_params == muon
    unpadded = ModelSizes(total_params=sizes.total_params, muon_params=muon)
    assert estimate(unpadded, stage=0, optimizer="muon").gpu.optimizer == 4 * muon + 8 * adam_numel


def _state_bytes(rank: int, world_size: int) -> int:
    engine = _engine(_config(0))
    _train(engine, rank, world_size, range(1))
    return engine.memory_breakdown().optimizer_bytes


class _NoMatrices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x) * self.scale


def test_muon_refuses_a_model_without_hidden_matrices_and_unknown_keys() -> None:
    import runtime

    with pytest.raises(MuonSplitError, match="no 2-D hidden weight") as caught:
        runtime.initialize(model=_NoMatrices(), config=_config(0))
    assert str(caught.value).startswith("optimizer.type Muon: ") and "\n" not in str(caught.value)
    split = make_model(0)
    split.hidden.weight.tensor_model_parallel = True  # a tensor-parallel shard is not the whole matrix
    with pytest.raises(MuonSplitError, match=r"hidden\.weight is split over the model-parallel group"):
        muon_split(split)
    bad = copy.deepcopy(_config(0))
    bad["optimizer"]["params"]["ns_step"] = 3
    with pytest.raises(ConfigError, match=r"optimizer\.params\.ns_step.*ns_steps"):
        runtime.initialize(model=make_model(0), config=bad)
    bad["optimizer"]["params"] = {"lr": 0.02, "muon_lr": 0.01}
    with pytest.raises(ConfigError, match=r"optimizer\.params\.muon_lr"):
        runtime.initialize(model=make_model(0), config=bad)


def test_matrix_owners_balance_newton_schulz_work_over_ranks() -> None:
    """Each matrix is orthogonalized on one rank; the largest first onto the least-loaded rank."""
    from runtime.zero.muon_shards import assign_owners

    shapes = [torch.Size(s) for s in ((4, 4), (8, 8), (2, 2), (8, 8), (16, 4))]
    assert assign_owners(shapes, 2) == [1, 0, 1, 1, 0]  # loads: 512 + 256 = 768 and 512 + 64 + 8 = 584
    assert assign_owners(shapes, 1) == [0] * 5


FP32_STATES = {"enabled": True}  # bf16 weights, fp32 masters and momentum
BF16_STATES = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _precision_round_trip(rank: int, world_size: int, ckpt: str) -> dict:
    """Muon with fp32 states saved (stage 2, offloaded) and resumed with bf16 states (stage 3), and bf16
    states saved (stage 2, half offloaded) and resumed with fp32 ones (stage 1, offloaded)."""
    from tests.support.logs import captured_log

    out = {}
    legs = (("to_bf16", FP32_STATES, (2, True, 1.0), BF16_STATES, (3, False, 1.0)),)
    legs += (("to_fp32", BF16_STATES, (2, True, 0.5), FP32_STATES, (1, True, 1.0)),)
    for name, saved_bf16, (stage, offload, ratio), loaded_bf16, (stage2, offload2, ratio2) in legs:
        source = _engine({**_config(stage, offload=offload, ratio=ratio), "bf16": saved_bf16})
        before = _train(source, rank, world_size, range(2))
        source.save_checkpoint(ckpt, tag=name)
        saved = source.full_state_dict()
        straight = _train(source, rank, world_size, range(2, STEPS))
        with captured_log("runtime.checkpoint") as records:
            target = _engine({**_config(stage2, offload=offload2, ratio=ratio2), "bf16": loaded_bf16})
            target.load_checkpoint(ckpt, tag=name)
        out[name] = {
            "before": before,
            "straight": straight,
            "saved": saved,
            "loaded": target.full_state_dict(),
            "momentum": sorted(
                {
                    str(s["momentum_buffer"].dtype)
                    for s in target.optimizer.state.values()
                    if "momentum_buffer" in s
                }
            ),
            "log": [m for m in records if "converting" in m],
            "again": _train(target, rank, world_size, range(2, STEPS)),
        }
    return out


def test_muon_with_bf16_states_resumes_at_the_other_state_precision(tmp_path) -> None:
    """World 2: a checkpoint of fp32 masters and momentum resumes with bf16 ones (masters rounded to
    nearest, momentum converted, said in the log) and back; the resumed run's first step equals the
    unbroken one's (the bf16 working weights are the same), later ones stay within bf16 state noise; and
    bf16 states train like fp32 states."""
    got = run_distributed(_precision_round_trip, 2, str(tmp_path))[0]
    to_bf16, to_fp32 = got["to_bf16"], got["to_fp32"]
    assert to_bf16["momentum"] == ["torch.bfloat16"] and to_fp32["momentum"] == ["torch.float32"]
    conversion = "checkpoint: converting master weights {} -> {}, optimizer moments {} -> {} on load"
    assert to_bf16["log"][0].startswith(conversion.format(*["float32", "bfloat16"] * 2)), to_bf16["log"]
    assert to_fp32["log"][0].startswith(conversion.format(*["bfloat16", "float32"] * 2)), to_fp32["log"]
    for name, value in to_bf16["saved"].items():  # fp32 masters rounded to the nearest bf16
        assert torch.equal(to_bf16["loaded"][name], value.to(torch.bfloat16).to(value.dtype)), name
    for name, value in to_fp32["saved"].items():  # bf16 masters are exact in fp32
        assert torch.equal(to_fp32["loaded"][name].float(), value.float()), name
    for leg in (to_bf16, to_fp32):
        assert leg["again"][0] == leg["straight"][0]
        # measured: 0.0016 (to bf16) and 0.0017 (to fp32) apart at the second step
        assert leg["again"][1] == pytest.approx(leg["straight"][1], abs=0.01)
    # 4 steps of bf16 states (stochastic rounding) against fp32 states; measured: at most 0.0033 apart
    fp32_run = to_bf16["before"] + to_bf16["straight"]
    bf16_run = to_fp32["before"] + to_fp32["straight"]
    assert bf16_run[0] == fp32_run[0]
    assert bf16_run == pytest.approx(fp32_run, abs=0.01)


def _drift(bf16: dict, steps: int = 20) -> float:
    """Mean change of a 64 x 64 weight of ones after `steps` Muon steps of lr 0.02 on a gradient of
    constant sign (rank one, so O's elements are all alike): 0.0042 in fp32, each step's 2.1e-4 far below
    half a bf16 ulp at 1.0 (0.0039)."""
    import runtime

    model = torch.nn.Linear(64, 64, bias=False)
    torch.nn.init.ones_(model.weight)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "bf16": bf16,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.0}},
        "steps_per_print": 0,
    }
    engine, *_ = runtime.initialize(model=model, config=config)
    x = torch.rand(4, 64, generator=torch.Generator().manual_seed(0)) + 0.5
    for _ in range(steps):
        engine.backward(engine(x).float().sum())
        engine.step()
    weight = engine.full_state_dict()["weight"].float()
    engine.destroy()
    return float((1.0 - weight).mean())


def test_muon_on_bf16_masters_rounds_stochastically() -> None:
    """bf16.stochastic_rounding (the default) with Muon: updates below half a bf16 ulp survive on average,
    where round-to-nearest loses every one."""
    fp32 = _drift(FP32_STATES)
    nearest = _drift({**BF16_STATES, "stochastic_rounding": False})
    stochastic = _drift(BF16_STATES)
    assert fp32 == pytest.approx(0.0042, rel=0.05)
    assert nearest == 0.0  # every update rounded away
    assert stochastic == pytest.approx(fp32, rel=0.05)  # measured: 0.00417 against 0.00422 (4096 weights)
