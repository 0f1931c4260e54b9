"""The fp16 loss-scale state machine (runtime.precision.loss_scaler): DeepSpeed's semantics, step by step."""

from __future__ import annotations

import pytest

from runtime.precision.loss_scaler import DynamicLossScaler, LossScaleError, StaticLossScaler


def run(scaler: DynamicLossScaler, overflows: str) -> list[float]:
    """Feed 'o' (overflow) / '.' (clean) steps; return the scale after each."""
    return [scaler.update(flag == "o").new_scale for flag in overflows]


def test_starts_at_two_to_the_initial_power() -> None:
    assert DynamicLossScaler(initial_scale_power=16).scale == 65536.0
    assert DynamicLossScaler(initial_scale_power=0).scale == 1.0


def test_hysteresis_absorbs_overflows_until_the_scale_grows_again() -> None:
    scaler = DynamicLossScaler(initial_scale_power=4, window=3, hysteresis=2)
    # o: absorbed (hysteresis 2 -> 1); three clean steps: x2 and hysteresis refilled; o: absorbed;
    # o, o: each halves now (hysteresis stays used up until the next growth)
    assert run(scaler, "o...ooo") == [16, 16, 16, 32, 32, 16, 8]
    assert scaler.hysteresis_left == 1


def test_without_consecutive_hysteresis_clean_steps_do_not_refill() -> None:
    scaler = DynamicLossScaler(initial_scale_power=4, window=100, hysteresis=2)
    assert run(scaler, "o.o") == [16, 16, 8]


def test_consecutive_hysteresis_needs_consecutive_overflows() -> None:
    scaler = DynamicLossScaler(initial_scale_power=4, window=100, hysteresis=2, consecutive_hysteresis=True)
    assert run(scaler, "o.o") == [16, 16, 16]  # the clean step refilled the hysteresis
    assert run(scaler, "o") == [8]  # second overflow in a row halves


def test_grows_after_window_clean_steps_since_the_last_overflow() -> None:
    scaler = DynamicLossScaler(initial_scale_power=2, window=4, hysteresis=1)
    assert run(scaler, "...") == [4, 4, 4]
    assert run(scaler, ".") == [8]  # 4 clean steps
    assert run(scaler, "o") == [4]
    assert run(scaler, "...") == [4, 4, 4]
    assert run(scaler, ".") == [8]  # window counts from the overflow
    assert run(scaler, "....") == [8, 8, 8, 16]


def test_halving_stops_at_min_scale_then_raises_with_advice() -> None:
    scaler = DynamicLossScaler(initial_scale_power=2, hysteresis=1, min_scale=1.5)
    assert run(scaler, "oo") == [2, 1.5]  # clamped to min_loss_scale
    with pytest.raises(LossScaleError) as info:
        scaler.update(True, step=42)
    message = str(info.value)
    assert "step 42" in message and "min_loss_scale" in message and "\n" not in message
    assert "3 consecutive" in message
    assert "bf16" in info.value.hint and "gradient_clipping" in info.value.hint


def test_update_reports_what_happened() -> None:
    scaler = DynamicLossScaler(initial_scale_power=3, hysteresis=1)
    update = scaler.update(True)
    assert (update.overflow, update.old_scale, update.new_scale) == (True, 8.0, 4.0)


def test_state_dict_round_trip_continues_identically() -> None:
    a = DynamicLossScaler(initial_scale_power=5, window=3, hysteresis=2)
    run(a, "o..o.")
    b = DynamicLossScaler(initial_scale_power=20, window=3, hysteresis=2)  # settings come from the config
    b.load_state_dict(a.state_dict())
    pattern = "..oo...o."
    assert run(a, pattern) == run(b, pattern)


def test_static_scale_never_moves() -> None:
    scaler = StaticLossScaler(128.0)
    assert [scaler.update(flag).new_scale for flag in (True, True, False)] == [128.0] * 3
    with pytest.raises(ValueError, match="> 0"):
        StaticLossScaler(0.0)


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="loss_scale_window"):
        DynamicLossScaler(window=0)
    with pytest.raises(ValueError, match="hysteresis"):
        DynamicLossScaler(hysteresis=0)
    with pytest.raises(ValueError, match="min_loss_scale"):
        DynamicLossScaler(min_scale=0)


# -- end to end: an overflow on one rank skips the step on every rank -------------------------------------

INJECT_STEP = 2


def _fp16_config(stage: int, **fp16: float) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 0,
        "fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8, "hysteresis": 1, **fp16},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": 1e-2,
                "warmup_num_steps": 5,
                "warmup_type": "linear",
            },
        },
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 700},
    }


def _poison_on(model: object, rank: int, world_size: int, when: object) -> None:
    """Make one gradient element inf on the last rank whenever `when()` is true."""
    import torch

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad.index_fill(0, torch.tensor([1]), float("inf")) if when() else grad

    if rank == world_size - 1:
        model.out.bias.register_hook(hook)  # type: ignore[attr-defined]


def _overflow_worker(rank: int, world_size: int) -> dict:
    import torch

    import runtime
    from runtime.precision.loss_scaler import LossScaleError
    from tests.support.models import loss_fn, make_model, rank_batch

    out: dict = {}
    for stage in (0, 1, 2):
        model = make_model(0)
        engine, _, _, _ = runtime.initialize(model=model, config=_fp16_config(stage))
        step_box = [0]
        _poison_on(model, rank, world_size, lambda box=step_box: box[0] == INJECT_STEP)
        trace = []
        for step in range(4):
            step_box[0] = step
            x, y = rank_batch(step, 0, 2 * world_size, rank, world_size)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
            trace.append(
                {
                    "applied": engine.was_step_applied(),
                    "scale": engine.loss_scale,
                    "lr": engine.get_lr()[0],
                    "skipped": engine.skipped_steps,
                    "master": engine.full_state_dict(rank0_only=False),
                    "working": {n: p.detach().clone() for n, p in model.named_parameters()},
                }
            )
        out[stage] = trace
        engine.destroy()

    # at the minimum scale an overflow is an error on every rank, naming the step
    model = make_model(0)
    engine, _, _, _ = runtime.initialize(
        model=model, config=_fp16_config(2, initial_scale_power=1, min_loss_scale=1.0)
    )
    _poison_on(model, rank, world_size, lambda: True)
    out["min_scale_error"] = None
    for step in range(3):
        x, y = rank_batch(step, 0, 2 * world_size, rank, world_size)
        engine.backward(loss_fn(engine(x), y))
        try:
            engine.step()
        except LossScaleError as error:
            out["min_scale_error"] = (step, str(error), engine.skipped_steps, error.hint)
            break
    engine.destroy()
    del torch
    return out


def _same(a: dict, b: dict) -> bool:
    import torch

    return all(torch.equal(a[k], b[k]) for k in a)


def test_overflow_on_one_rank_skips_the_step_on_every_rank() -> None:
    from tests.support.dist import run_distributed

    results = run_distributed(_overflow_worker, 3, timeout=120)
    for rank, out in enumerate(results):
        for stage in (0, 1, 2):
            trace = out[stage]
            where = f"rank {rank} stage {stage}"
            assert [t["applied"] for t in trace] == [True, True, False, True], where
            assert [t["skipped"] for t in trace] == [0, 0, 1, 1], where
            assert [t["scale"] for t in trace] == [256.0, 256.0, 128.0, 128.0], where
            # weights untouched by the skipped step, and the scheduler did not advance
            assert _same(trace[2]["master"], trace[1]["master"]), where
            assert _same(trace[2]["working"], trace[1]["working"]), where
            assert trace[2]["lr"] == trace[1]["lr"] and trace[3]["lr"] > trace[2]["lr"], where
            # the next step trains again, with finite weights
            assert not _same(trace[3]["master"], trace[2]["master"]), where
            assert all(v.isfinite().all() for v in trace[3]["master"].values()), where
        step, message, skipped, hint = out["min_scale_error"]
        assert step == 1 and skipped == 2, (rank, out["min_scale_error"])  # both steps were skipped
        assert "at step 2" in message and "min_loss_scale" in message and "bf16" in hint
