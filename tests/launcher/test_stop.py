"""The stop sequence's transitions (launcher.stop): plain calls with explicit times, no processes."""

from __future__ import annotations

import pytest

from launcher.stop import StopAction, StopSequence, StopState

NOTHING, TERMINATE, KILL = StopAction.NOTHING, StopAction.TERMINATE, StopAction.KILL


def test_a_stop_terminates_then_the_end_of_the_grace_period_kills_once() -> None:
    seq = StopSequence(grace=5.0)
    assert seq.state is StopState.RUNNING and not seq.stopping
    assert seq.tick(100.0) is NOTHING
    assert seq.stop(100.0, "worker_failed") is TERMINATE
    assert (seq.state, seq.reason, seq.kill_deadline) == (StopState.STOPPING, "worker_failed", 105.0)
    assert seq.tick(104.99) is NOTHING
    assert seq.tick(105.0) is KILL
    assert (seq.state, seq.killed_at) == (StopState.KILLING, 105.0)
    assert seq.tick(200.0) is NOTHING  # the kill goes out once
    seq.finish()
    assert seq.state is StopState.DONE
    assert seq.stop(201.0, "signal", interrupt=True) is NOTHING and seq.kill(201.0, "kill") is NOTHING


def test_a_stop_request_while_stopping_keeps_the_grace_period() -> None:
    # Issue 19: the head's stop reaching an agent that already stopped on a worker's failure.
    seq = StopSequence(grace=5.0)
    assert seq.stop(10.0, "worker_failed") is TERMINATE
    assert seq.stop(10.02, "stop_command") is NOTHING
    assert seq.stop(10.03, "stdin_eof") is NOTHING
    assert seq.stop(11.0, "signal", interrupt=True) is NOTHING  # one SIGTERM (srun forwarding a stop)
    assert (seq.state, seq.reason, seq.kill_deadline) == (StopState.STOPPING, "worker_failed", 15.0)


def test_the_second_interrupt_kills_whatever_started_the_stop() -> None:
    seq = StopSequence(grace=60.0)
    assert seq.stop(0.0, "SIGINT", interrupt=True) is TERMINATE
    assert seq.stop(1.0, "SIGINT", interrupt=True) is KILL
    assert seq.state is StopState.KILLING
    after_failure = StopSequence(grace=60.0)
    assert after_failure.stop(0.0, "failure") is TERMINATE
    assert after_failure.stop(1.0, "SIGINT", interrupt=True) is NOTHING  # the user's first Ctrl-C
    assert after_failure.stop(2.0, "SIGINT", interrupt=True) is KILL  # the second


def test_an_explicit_kill_kills_from_running_or_stopping_and_only_once() -> None:
    seq = StopSequence(grace=5.0)
    assert seq.kill(3.0, "kill_command") is KILL
    assert (seq.state, seq.reason, seq.killed_at) == (StopState.KILLING, "kill_command", 3.0)
    assert seq.kill(4.0, "kill_command") is NOTHING and seq.stop(4.0, "stop_command") is NOTHING
    stopping = StopSequence(grace=5.0)
    stopping.stop(0.0, "stop_command")
    assert stopping.kill(1.0, "kill_command") is KILL and stopping.reason == "stop_command"


def test_a_zero_grace_period_kills_on_the_next_tick_and_a_negative_one_is_refused() -> None:
    seq = StopSequence(grace=0.0)
    assert seq.stop(7.0, "worker_failed") is TERMINATE and seq.tick(7.0) is KILL
    with pytest.raises(ValueError, match="grace period -1"):
        StopSequence(grace=-1)
