"""The walk of scripts/bench/long_context.py without a GPU: the lengths it tries against a pretend machine
whose limit is known, the time limit keeping a too-slow length untried, and the summary's estimate for an
allocator-capped GPU."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from runtime.estimator.fit import GIB, allocator_capped
from runtime.estimator.longest import LLAMA_SHAPES, LongSequenceSetup, longest_sequence
from runtime.estimator.step_flops import step_flops, step_seconds
from scripts.bench.long_context import estimate_summary
from scripts.bench.long_context_walk import WalkPlan, next_length, too_slow, walk_lengths


def _machine(limit: int) -> tuple[list[int], Callable[[int], bool]]:
    """The lengths tried, and an attempt that trains every length up to `limit`."""
    tried: list[int] = []

    def attempt(seq: int) -> bool:
        tried.append(seq)
        return seq <= limit

    return tried, attempt


def test_doubling_then_bisecting_finds_the_limit_within_the_resolution() -> None:
    tried, attempt = _machine(limit=100_000)
    result = walk_lengths(WalkPlan(start=16384, max=1 << 22), attempt, lambda seq: None)
    assert tried[:4] == [16384, 32768, 65536, 131072]
    assert result.stopped_by == "failed" and result.tried == tried
    assert result.longest <= 100_000 < result.shortest_failed  # type: ignore[operator]
    assert 100_000 - result.longest <= 0.05 * result.longest


def test_a_small_growth_started_at_the_estimate_brackets_it_in_two_tries() -> None:
    # what a device command of a few minutes affords for the 8B shape: the estimate, then 5% more
    tried, attempt = _machine(limit=35_000)
    result = walk_lengths(WalkPlan(start=34816, max=40960, growth=1.05), attempt, lambda seq: None)
    assert tried == [34816, 35840]
    assert (result.longest, result.shortest_failed, result.stopped_by) == (34816, 35840, "failed")
    assert next_length(34816, 1.05, 1024) == 35840  # rounded down to a multiple: within 5%
    assert next_length(96, 1.05, 1024) == 96 + 1024  # at least one multiple more
    with pytest.raises(ValueError, match="growth"):
        WalkPlan(start=1024, max=4096, growth=1.0)


def test_a_growth_past_max_tries_max_itself() -> None:
    # 2026-12-06: 342,016 x 1.11 passed --max 377,856, and the walk ended without trying 377,856
    tried, attempt = _machine(limit=1 << 30)
    result = walk_lengths(WalkPlan(start=342016, max=377856, growth=1.11), attempt, lambda seq: None)
    assert tried == [342016, 377856]
    assert (result.longest, result.stopped_by) == (377856, "max")
    tried, attempt = _machine(limit=360_000)
    result = walk_lengths(WalkPlan(start=342016, max=377856, growth=1.11), attempt, lambda seq: None)
    assert tried[:2] == [342016, 377856] and result.shortest_failed is not None


def test_the_time_limit_keeps_a_too_slow_length_untried() -> None:
    tried, attempt = _machine(limit=1 << 30)  # memory never stops this walk

    def predict_s(seq: int) -> float | None:
        return None if not tried else seq / 10_000  # 10K tokens a second, once something was measured

    result = walk_lengths(WalkPlan(start=16384, max=1 << 22, time_limit=5.0), attempt, predict_s)
    assert tried == [16384, 32768]  # 65536 tokens would take 6.6 s a step
    assert (result.longest, result.stopped_by, result.would_try) == (32768, "time", 65536)
    assert too_slow(None, 1.0) is False  # the first length is always tried
    assert too_slow(2.0, None) is False and too_slow(2.0, 1.0) is True


def test_the_summary_estimates_for_the_capped_gpu_and_says_which_side_binds() -> None:
    shape, setup = LLAMA_SHAPES["8b"], LongSequenceSetup()
    capped = allocator_capped(40 * GIB, 120 * GIB)
    expected = longest_sequence(shape, capped, setup)
    keys = estimate_summary(shape, setup, capped, longest=expected.seq_len - 1024, hw_tflops=300.0)
    assert keys["estimate"] == expected.seq_len and keys["estimate_binds"] == "gpu"
    assert keys["estimate_error"] == round(expected.seq_len / (expected.seq_len - 1024) - 1, 4)
    assert keys["estimate_machine"] == {"gpu_gib": round(capped.gpu_bytes / GIB, 2), "host_gib": 120.0}
    step_s = step_seconds(step_flops(shape, expected.seq_len, setup), 300.0)
    assert keys["step_s_at_estimate"] == round(step_s, 2)
    assert "estimate_note" not in keys
    # a host too small for the same cap: the host term binds first, and the summary says so
    small_host = allocator_capped(40 * GIB, 112 * GIB)
    keys = estimate_summary(shape, setup, small_host, longest=0, hw_tflops=None)
    assert "host" in keys["estimate_binds"] and "host term binds" in keys["estimate_note"]
    assert keys["estimate_error"] is None and keys["step_s_at_estimate"] is None
