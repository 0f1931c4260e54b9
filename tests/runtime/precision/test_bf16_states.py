"""16-bit model states: `bf16.bf16_master_weights_and_grads`, `bf16.bf16_optimizer_states`, our
`bf16.stochastic_rounding`, and the `torch_autocast` section.

What a user relies on: the master and moment bytes really halve at every ZeRO stage, with and without
optimizer offload and a `ratio` split, on one rank and two, and offload steps them to the same weights
as the un-offloaded run (the device step declines them, saying why); training with bf16 states tracks
fp32 states; updates too small for a bf16 weight are not lost (stochastic rounding), where plain
round-to-nearest loses them; checkpoints move between the settings; bad combinations are refused naming
the key.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from runtime.checkpoint import get_fp32_state_dict_from_checkpoint
from runtime.config import ConfigError, load_config
from runtime.models import GPT, GPTConfig
from tests.support.dist import run_distributed
from tests.support.models import loss_fn, make_model, param_groups, rank_batch
from tests.support.paths import TESTS

BF16 = {"enabled": True}
STATES16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
MASTERS16 = {"enabled": True, "bf16_master_weights_and_grads": True}  # moments stay fp32
NEAREST16 = {**STATES16, "stochastic_rounding": False}
AUTOCAST = {"torch_autocast": {"enabled": True}}
ZEROS = [
    {"stage": 1},
    {"stage": 2},
    {"stage": 3},
    {"stage": 2, "offload_optimizer": {"device": "cpu", "update": "device"}},  # bf16 masters: the host's step
    {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
    {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
    {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
]


def _config(bf16: dict[str, Any], zero: dict[str, Any], world_size: int) -> dict[str, Any]:
    precision = AUTOCAST if bf16 is AUTOCAST else {"bf16": bf16}
    return {
        "train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        **precision,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "steps_per_print": 0,
    }


def _state_bytes(rank: int, world_size: int) -> list[dict[str, Any]]:
    """Per ZeRO setting, the fp32-state and the bf16-state engines' memory after 3 steps, and losses."""
    import runtime

    out = []
    for zero in ZEROS:
        row: dict[str, Any] = {"zero": zero}
        variants = (
            ("fp32", BF16),
            ("bf16", STATES16),
            ("masters", MASTERS16),
            ("autocast", AUTOCAST),
            ("nearest", NEAREST16),
        )
        for name, bf16 in variants:
            model = make_model(0)
            engine, *_ = runtime.initialize(
                model=model, model_parameters=param_groups(model), config=_config(bf16, zero, world_size)
            )
            losses = []
            for step in range(3):
                x, y = rank_batch(step, 0, 8, rank, world_size)
                loss = loss_fn(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            states = engine.optimizer.state.values()
            row[name] = {
                "memory": engine.memory_breakdown(),
                "steps": sum(s["step"].numel() * 4 for s in states),
                "dtypes": sorted({str(t.dtype) for s in states for k, t in s.items() if k != "step"}),
                "masters": sorted({str(g.master.dtype) for g in engine.groups}),
                "losses": losses,
                "kind": type(engine.optimizer).__name__,
                "weights": engine.full_state_dict(),
                "update": getattr(getattr(engine.masters, "update", None), "reason", None),
            }
            engine.destroy()
        out.append(row)
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_bf16_masters_and_states_halve_their_bytes_at_every_stage(world_size: int) -> None:
    per_rank = run_distributed(_state_bytes, world_size, timeout=240)
    for rank_rows in per_rank:
        for row in rank_rows:
            fp32, bf16 = row["fp32"], row["bf16"]
            where = f"{row['zero']} world {world_size}"
            assert bf16["kind"] == "MasterAdam" and fp32["kind"] == "AdamW", where
            assert bf16["dtypes"] == ["torch.bfloat16"] and fp32["dtypes"] == ["torch.float32"], where
            assert bf16["masters"] == ["torch.bfloat16"], where
            # moments: 8 bytes a parameter -> 4; the step counters (4 bytes each) stay
            f, b = fp32["memory"], bf16["memory"]
            assert f.optimizer_bytes - fp32["steps"] == 2 * (b.optimizer_bytes - bf16["steps"]) > 0, where
            # masters: fp32 copies -> none on the device (the bf16 working shard is the master), bf16
            # copies on the host under offload: at least halved, on both sides of a ratio split
            assert b.master_bytes * 2 <= f.master_bytes, where
            if "offload_param" in row["zero"]:  # the host's bf16 weights stay; masters and moments halve
                saved = f.master_bytes - b.master_bytes + f.optimizer_bytes - b.optimizer_bytes
                assert f.host_bytes - b.host_bytes == saved, where
            else:
                assert b.host_bytes * 2 <= f.host_bytes + 2 * bf16["steps"], where
            if "offload_optimizer" not in row["zero"]:
                assert b.master_bytes == 0 < f.master_bytes and f.host_bytes == 0, where
            # the first step's loss is the same model's; later ones stay within bf16 noise
            assert bf16["losses"][0] == fp32["losses"][0], where
            assert max(abs(a - c) for a, c in zip(bf16["losses"], fp32["losses"], strict=True)) < 0.02, where
            # bf16 masters alone: the moments stay fp32 (8 bytes), the masters shrink as above
            masters = row["masters"]
            assert masters["masters"] == ["torch.bfloat16"] and masters["dtypes"] == ["torch.float32"], where
            assert masters["memory"].optimizer_bytes == f.optimizer_bytes, where
            assert masters["memory"].master_bytes == b.master_bytes, where
            assert max(abs(a - c) for a, c in zip(masters["losses"], fp32["losses"], strict=True)) < 0.02
            # torch_autocast: fp32 weights and masters, torch's AdamW, a bf16 forward's losses
            autocast = row["autocast"]
            assert autocast["kind"] == "AdamW" and autocast["dtypes"] == ["torch.float32"], where
            # fp32 weights (the Linears' and the LayerNorm's in flat groups of their own, since their
            # gradients travel in bf16 and fp32: lower_precision_safe_modules; each group padded)
            assert 2 * f.param_bytes <= autocast["memory"].param_bytes < 2.2 * f.param_bytes, where
            assert max(abs(a - c) for a, c in zip(autocast["losses"], fp32["losses"], strict=True)) < 0.05
            # offload, a ratio split and offload_param step the same masters with the same arithmetic:
            # round-to-nearest weights equal the un-offloaded run's at the same stage, bit for bit; with
            # stochastic rounding too where the shard's layout is the same (the noise is keyed by position
            # in the optimizer's flat groups, which a ratio split at stages 1-2 regroups)
            stage, offload = row["zero"]["stage"], row["zero"].get("offload_optimizer", {})
            same = next(r for r in rank_rows if r["zero"] == {"stage": stage})
            regrouped = stage < 3 and offload.get("ratio", 1) < 1
            for name in ("nearest",) if regrouped else ("nearest", "bf16", "masters"):
                for key, value in same[name]["weights"].items():
                    assert torch.equal(row[name]["weights"][key], value), (where, name, key)
            if offload.get("update") == "device":  # on a CPU the device step runs in host memory
                assert fp32["update"].startswith("the GPU runs the Adam step on state streamed"), where
                assert bf16["update"] == (
                    "the CPU runs the Adam step: bf16 master weights: their Adam (stochastic rounding, bf16 "
                    "moments) is its own step"
                ), where


def _drift(bf16: dict[str, Any], steps: int = 20) -> float:
    """Mean change of weights that start at 1.0 after `steps` AdamW steps of lr 1e-3 with a gradient of
    constant sign: 0.02 exactly in fp32, below half a bf16 ulp at 1.0 (2^-9 = 0.00195) each step."""
    import runtime

    model = torch.nn.Linear(64, 64, bias=False)
    torch.nn.init.ones_(model.weight)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "bf16": bf16,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "steps_per_print": 0,
    }
    engine, *_ = runtime.initialize(model=model, config=config)
    x = torch.rand(4, 64) + 0.5
    for _ in range(steps):
        engine.backward(engine(x).float().sum())
        engine.step()
    weight = engine.full_state_dict()["weight"].float()
    engine.destroy()
    return float((1.0 - weight).mean())


def test_stochastic_rounding_keeps_the_updates_round_to_nearest_loses() -> None:
    fp32 = _drift(BF16)
    nearest = _drift({**STATES16, "stochastic_rounding": False})
    stochastic = _drift(STATES16)
    assert fp32 == pytest.approx(0.02, rel=1e-3)
    assert nearest == 0.0  # every update rounded away
    assert stochastic == pytest.approx(fp32, rel=0.05)  # measured: 0.0204 against 0.0200 (4096 weights)


TINY_GPT = GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=128, max_seq_len=32)


def _gpt_losses(bf16: dict[str, Any], steps: int = 50) -> list[float]:
    import runtime

    torch.manual_seed(0)
    model = GPT(TINY_GPT)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "bf16": bf16,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
        "steps_per_print": 0,
    }
    engine, *_ = runtime.initialize(model=model, config=config)
    data = torch.Generator().manual_seed(1)
    # a learnable stream: each token is the previous one plus 1 (mod 16), from a random start
    losses = []
    for _ in range(steps):
        start = torch.randint(0, 16, (8, 1), generator=data)
        tokens = (start + torch.arange(33)) % 16
        loss = engine(tokens[:, :-1], tokens[:, 1:]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses


def test_a_step_taken_later_uses_the_settings_read_before() -> None:
    """Device: CPU. The delayed offloaded update runs `MasterAdam.step` on a worker thread while the
    caller's scheduler already moves the lr: `step(hyperparameters=...)` with the settings read at the
    engine's step equals the step taken then, whatever the groups say by the time it runs."""
    from runtime.precision.master_adam import MasterAdam

    torch.manual_seed(0)
    weights = torch.randn(4096, dtype=torch.bfloat16)
    grad = torch.randn(4096, dtype=torch.bfloat16)
    runs = []
    for late in (False, True):
        p = torch.nn.Parameter(weights.clone())
        p.grad = grad.clone()
        opt = MasterAdam([p], lr=1e-2, weight_decay=0.1, state_dtype=torch.bfloat16)
        settings = opt.hyperparameters()
        if late:
            opt.param_groups[0]["lr"] = 1.0  # the scheduler, before the worker reads the group
            opt.step(hyperparameters=settings)
        else:
            opt.step()
        runs.append(p.detach().clone())
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], weights)


def test_bf16_states_track_fp32_states_on_a_tiny_gpt() -> None:
    fp32 = _gpt_losses(BF16)
    bf16 = _gpt_losses(STATES16)
    nearest = _gpt_losses({**STATES16, "stochastic_rounding": False})
    assert fp32[-1] < 0.05 * fp32[0]  # it learns: 4.87 -> 0.04
    fp32_tail, bf16_tail, nearest_tail = (sum(run[-10:]) / 10 for run in (fp32, bf16, nearest))
    # measured: the last 10 steps' mean loss is 0.0530 with fp32 states, 0.0528 with bf16 states and
    # stochastic rounding (0.4% apart; bounded at 5%), 0.0845 with round-to-nearest (60% worse)
    assert abs(bf16_tail - fp32_tail) < 0.05 * fp32_tail, (fp32_tail, bf16_tail)
    assert nearest_tail > 1.3 * fp32_tail, (fp32_tail, nearest_tail)


def _engine(
    bf16: dict[str, Any], steps: int = 1, zero: dict[str, Any] | None = None, kind: str = "AdamW"
) -> Any:
    import runtime

    model = make_model(0)
    config = _config(bf16, zero or {"stage": 1}, 1)
    config["optimizer"]["type"] = kind
    engine, *_ = runtime.initialize(model=model, config=config)
    for _ in range(steps):
        x, y = rank_batch(0, 0, 8, 0, 1)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    return engine


@pytest.mark.parametrize(
    "zero", [{"stage": 2}, {"stage": 2, "offload_optimizer": {"device": "cpu"}}], ids=["device", "offloaded"]
)
def test_the_moments_exist_once_the_engine_is_built(zero: dict[str, Any]) -> None:
    """Made at setup, not in the first step: a first step whose backward runs without them would fit where
    no later one does (the 8B on an H200: 59.9 GiB in its first step, 67.5 from the second on)."""
    built = _engine(STATES16, steps=0, zero=zero)
    masters = [p for group in built.optimizer.param_groups for p in group["params"]]
    for p in masters:
        state = built.optimizer.state[p]
        assert float(state["step"]) == 0.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == torch.bfloat16 and state[key].device == p.device
            assert state[key].shape == p.shape and not state[key].any()
    built.destroy()  # the steps that follow are the parity tests' (their numbers did not move)


@pytest.mark.parametrize(("saved", "loaded"), [(BF16, STATES16), (STATES16, BF16)])
def test_a_checkpoint_resumes_at_the_other_state_precision(
    tmp_path: Any, caplog: pytest.LogCaptureFixture, saved: dict[str, Any], loaded: dict[str, Any]
) -> None:
    source = _engine(saved)
    source.save_checkpoint(str(tmp_path), tag="t")
    moments = [s["exp_avg"].clone() for s in source.optimizer.state.values()]
    # the consolidated (zero_to_fp32) state dict holds the masters, bf16 ones widened to fp32
    full = source.full_state_dict()
    consolidated = get_fp32_state_dict_from_checkpoint(str(tmp_path), tag="t")
    assert all(torch.equal(consolidated[k].float(), full[k].float()) for k in full)
    source.destroy()
    target = _engine(loaded, steps=0)  # a fresh run: its state is made by the load
    with caplog.at_level(logging.INFO):
        target.load_checkpoint(str(tmp_path), tag="t")
    want = torch.bfloat16 if loaded is STATES16 else torch.float32
    got = [s["exp_avg"] for s in target.optimizer.state.values()]
    assert [g.dtype for g in got] == [want] * len(got)
    for g, m in zip(got, moments, strict=True):
        assert torch.equal(g, m.to(want))  # the saved moments, converted
    assert any("checkpoint: converting" in r.getMessage() for r in caplog.records), caplog.text
    target.destroy()


def test_a_deepspeed_checkpoint_resumes_with_bf16_states() -> None:
    """DeepSpeed's own ZeRO-2 bf16 checkpoint (fp32 masters and moments) continues with bf16 ones."""
    import json

    import runtime
    from tests.fixtures.deepspeed import tiny

    folder = TESTS / "fixtures" / "deepspeed" / "zero2_bf16"
    expected = json.loads((folder / "expected.json").read_text())
    model = tiny.make_model(123, frozen=expected["frozen"])
    config = {**tiny.config(2, "bf16", 1), "bf16": STATES16}
    engine, *_ = runtime.initialize(model=model, model_parameters=tiny.param_groups(model), config=config)
    engine.load_checkpoint(str(folder / "ckpt"))
    assert {s["exp_avg"].dtype for s in engine.optimizer.state.values()} == {torch.bfloat16}
    losses = []
    for step in range(tiny.SAVED_AT + 1, tiny.SAVED_AT + tiny.CONTINUE + 1):
        x, y = tiny.batch(step, 0, 1)
        loss = tiny.loss_fn(engine(x.to(torch.bfloat16)), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    # DeepSpeed's continuation (fp32 states); measured: at most 0.0019 apart (0.0001 with our fp32 states)
    assert losses == pytest.approx(expected["continuation"], abs=0.01)


def test_a_resumed_run_rounds_as_the_unbroken_one(tmp_path: Any) -> None:
    """The rounding noise is a function of the step count, which the checkpoint keeps."""
    source = _engine(STATES16)
    source.save_checkpoint(str(tmp_path), tag="t")

    def two_more(engine: Any) -> list[torch.Tensor]:
        for step in (1, 2):
            x, y = rank_batch(step, 0, 8, 0, 1)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        return [g.master.detach().clone() for g in engine.groups]

    unbroken = two_more(source)
    source.destroy()
    resumed = _engine(STATES16)
    resumed.load_checkpoint(str(tmp_path), tag="t")
    assert all(torch.equal(a, b) for a, b in zip(two_more(resumed), unbroken, strict=True))
    resumed.destroy()


@pytest.mark.parametrize("kind", ["AdamW", "Muon"])
@pytest.mark.parametrize("zero", [ZEROS[0], ZEROS[4], ZEROS[6]], ids=["stage1", "ratio", "offload_param"])
def test_a_non_finite_step_is_skipped_with_bf16_states(zero: dict[str, Any], kind: str) -> None:
    """The step after a NaN batch is skipped whole: the bf16 masters and the optimizer's 16-bit state are
    the ones before it, on the device, split by a ratio, and offloaded with the weights."""
    engine = _engine(STATES16, zero=zero, kind=kind)
    before = [g.master.detach().clone() for g in engine.groups]
    state = [[t.clone() for t in s.values() if torch.is_tensor(t)] for s in engine.optimizer.state.values()]
    x, y = rank_batch(1, 0, 8, 0, 1)
    x[0, 0] = float("nan")
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    assert engine.skipped_steps == 1
    assert all(torch.equal(g.master, b) for g, b in zip(engine.groups, before, strict=True))
    after = [[t for t in s.values() if torch.is_tensor(t)] for s in engine.optimizer.state.values()]
    assert len(after) == len(state) > 0
    for old, new in zip(state, after, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(old, new, strict=True))
    engine.destroy()


BAD = [
    ({"bf16": {"bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states"),
    ({"bf16": {"bf16_master_weights_and_grads": True}}, "bf16.bf16_master_weights_and_grads"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states"),
    ({"bf16": STATES16, "zero_optimization": {"stage": 0}}, "bf16.bf16_master_weights_and_grads"),
    ({"bf16": STATES16, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, "bf16.stochastic_rounding"),
    (
        {
            "bf16": {**MASTERS16, "stochastic_rounding": False},
            "optimizer": {"type": "SGD", "params": {"lr": 1}},
        },
        "bf16.bf16_optimizer_states",
    ),
    # Muon on bf16 masters: its momentum is kept in the masters' dtype
    (
        {"bf16": {**MASTERS16, "stochastic_rounding": False}, "optimizer": {"type": "Muon", "params": {}}},
        "bf16.bf16_optimizer_states",
    ),
    ({"bf16": BF16, "torch_autocast": {"enabled": True, "dtype": "float16"}}, "torch_autocast.dtype"),
    ({"torch_autocast": {"enabled": True, "dtype": "float16"}}, "torch_autocast.dtype"),
    (
        {"torch_autocast": {"lower_precision_safe_modules": "torch.nn.Linear"}},
        "torch_autocast.lower_precision_safe_modules",
    ),
]


@pytest.mark.parametrize(("keys", "path"), BAD)
def test_bad_16_bit_combinations_are_refused_naming_the_key(keys: dict[str, Any], path: str) -> None:
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, **keys}
    with pytest.raises(ConfigError) as caught:
        load_config(config, world_size=1)
    assert str(caught.value).startswith(path), str(caught.value)
    assert "\n" not in str(caught.value)


def test_torch_autocast_keeps_fp32_weights_and_runs_the_forward_in_bf16() -> None:
    import runtime

    model = make_model(0)
    reference = make_model(0)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "steps_per_print": 0,
    }
    engine, *_ = runtime.initialize(model=model, config=config)
    x, _ = rank_batch(0, 0, 8, 0, 1)
    out = engine(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert {p.dtype for p in engine.module.parameters()} == {torch.float32}
    engine.destroy()
    # DeepSpeed's own example: bf16 weights with bf16 masters and moments, and autocast beside them
    losses = {}
    for autocast in (False, True):
        model = make_model(0)
        config16 = {**_config(STATES16, {"stage": 2}, 1), "torch_autocast": {"enabled": autocast}}
        engine, *_ = runtime.initialize(model=model, config=config16)
        for step in range(5):
            x, y = rank_batch(step, 0, 8, 0, 1)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
        losses[autocast] = loss.item()
        assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
        engine.destroy()
    assert losses[True] == pytest.approx(losses[False], abs=0.05)
    bad = {**config, "torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["torch.nn.Nope"]}}
    with pytest.raises(ConfigError, match=r"^torch_autocast.lower_precision_safe_modules: 'torch.nn.Nope'"):
        runtime.initialize(model=make_model(0), config=bad)


def test_the_estimator_and_auto_ratio_count_the_16_bit_states() -> None:
    from runtime.estimator import estimate
    from runtime.offload.auto_ratio import ActivationGuess, AutoFacts, auto_ratio

    n = 20_000_000_000  # 20B parameters, ZeRO-2 with the optimizer on the host of one H200
    fp32 = estimate(n, stage=2, offload_optimizer=True)
    bf16 = estimate(n, stage=2, offload_optimizer=True, master_dtype="bf16", state_dtype="bf16")
    assert (fp32.host_per_rank.master, fp32.host_per_rank.optimizer) == (4 * n, 8 * n)
    assert (bf16.host_per_rank.master, bf16.host_per_rank.optimizer) == (2 * n, 4 * n)
    on_device = estimate(n, stage=1, master_dtype="bf16", state_dtype="fp32")
    assert (on_device.gpu.master, on_device.gpu.optimizer) == (0, 8 * n)  # the working shard is the master
    with pytest.raises(ValueError, match="stage 1-3"):
        estimate(n, stage=0, master_dtype="bf16")

    gib = 1 << 30
    facts = dict(
        shard_numel=n,
        fixed_device_bytes=4 * n,  # bf16 weights and gradients
        device_capacity=int(139.5 * gib),
        host_available=int(124.8 * gib),
        activations=ActivationGuess(8 * gib, "a guess"),
        working_bytes=2,
    )
    with pytest.raises(ValueError, match="does not fit"):  # 16 bytes an element: 298 GiB
        auto_ratio(AutoFacts(**facts))
    choice = auto_ratio(AutoFacts(**facts, master_bytes=2, moment_bytes=4))  # 8 bytes on the host
    assert 0.0 < choice.ratio < 1.0, choice.reason


def test_ds_estimate_largest_counts_the_16_bit_states() -> None:
    from runtime.estimator.fit import Machine, Workload, fit_gpt

    h200 = Machine(gpu_bytes=int(139.5 * (1 << 30)), host_bytes=125 * (1 << 30), gpus_per_node=1)
    gpt20b = GPTConfig(n_layer=44, n_head=48, n_embd=6144, vocab_size=50304, max_seq_len=1024)
    assert 19e9 < gpt20b.num_params() < 21e9
    fp32 = fit_gpt(gpt20b, h200, Workload(), ratio="auto")
    bf16 = fit_gpt(gpt20b, h200, Workload(master_dtype="bf16", state_dtype="bf16"), ratio="auto")
    assert not fp32.fits and bf16.fits, (fp32.reason, bf16.reason)


def _autocast_wire(rank: int, world_size: int, ckpt: str) -> list[dict[str, Any]]:
    """Per ZeRO stage, autocast-only runs with the default safe modules and with none: the first step's
    reduced gradients by group, the bytes the reduction put on the wire, and the losses; each run saves,
    and the other setting's fresh engine resumes it."""
    import runtime

    out = []
    for stage in (0, 1, 2, 3):
        for modules in (None, []):
            autocast: dict[str, Any] = {"enabled": True}
            if modules is not None:
                autocast["lower_precision_safe_modules"] = modules
            config = {**_config(AUTOCAST, {"stage": stage}, world_size), "torch_autocast": autocast}
            engine, *_ = runtime.initialize(model=make_model(0), config=config)
            row: dict[str, Any] = {"stage": stage, "modules": modules, "losses": []}
            for step in range(3):
                x, y = rank_batch(step, 0, 8, rank, world_size)
                engine.comm.counter.reset()
                loss = loss_fn(engine(x), y)
                engine.backward(loss)
                if step == 0:
                    row["wire"] = sum(engine.comm.counter.bytes.values())
                    row["groups"] = {
                        tuple(sorted(g.param_names)): all(
                            torch.equal(p, p.bfloat16().float()) for p in pieces
                        )
                        for g, pieces in zip(engine.groups, engine.zero.grad_pieces(), strict=True)
                    }
                engine.step()
                row["losses"].append(loss.item())
            engine.save_checkpoint(ckpt, tag=f"s{stage}{'default' if modules is None else 'none'}")
            other = {
                **autocast,
                "lower_precision_safe_modules": [] if modules is None else ["torch.nn.Linear"],
            }
            resumed, *_ = runtime.initialize(model=make_model(0), config={**config, "torch_autocast": other})
            resumed.load_checkpoint(ckpt, tag=f"s{stage}{'default' if modules is None else 'none'}")
            ours, theirs = engine.full_state_dict(), resumed.full_state_dict()
            row["resumes"] = all(torch.equal(ours[k], theirs[k]) for k in ours)
            resumed.destroy()
            engine.destroy()
            out.append(row)
    return out


def test_lower_precision_safe_modules_reduce_their_gradients_in_the_autocast_dtype(tmp_path: Any) -> None:
    """DeepSpeed's meaning of torch_autocast.lower_precision_safe_modules: with fp32 weights under autocast,
    the gradients of those modules' own parameters (default: Linear, Conv1d-3d) are reduced in bf16, the
    rest in fp32. At ZeRO 0-3 on two ranks: the Linear gradients arrive bf16-exact, the LayerNorm's do not,
    the reduction moves 3584 bytes instead of 6656 (stages 1-3; 3456 of 6400 at stage 0), and the losses
    stay those of the all-fp32 reduction within bf16 noise; a checkpoint resumes under the other setting
    (the optimizer sees the same param groups)."""
    linears = ("inp.bias", "inp.weight", "hidden.bias", "hidden.weight", "out.bias", "out.weight")
    rows = run_distributed(_autocast_wire, 2, str(tmp_path))[0]
    for low, full in zip(rows[::2], rows[1::2], strict=True):
        where = f"stage {low['stage']}"
        assert full["modules"] == [] and len(full["groups"]) == 1, where  # nothing in bf16: one group
        assert not any(full["groups"].values()), where
        exact = {name: value for names, value in low["groups"].items() for name in names}
        assert exact == {**dict.fromkeys(linears, True), "norm.bias": False, "norm.weight": False}, where
        assert (low["wire"], full["wire"]) == ((3456, 6400) if low["stage"] == 0 else (3584, 6656)), where
        assert low["losses"] == pytest.approx(full["losses"], abs=0.01), where
        assert low["resumes"] and full["resumes"], where
