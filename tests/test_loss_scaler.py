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
    assert "step 42" in message and "min_loss_scale" in message and "bf16" in message
    assert "3 consecutive" in message


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
