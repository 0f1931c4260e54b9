"""dslaunch when workers fail, end to end with real processes: the survivors' grace period, and the
failure summary built from the workers' error files (folded when ranks fail the same way)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist import free_port
from tests.launching import SCRIPTS, run_dslaunch
from tests.sshd_testbed import Testbed


def _grace_job(tmp_path: Path, grace: str):
    saved, ready = tmp_path / "saved", tmp_path / "ready"
    saved.mkdir()
    ready.mkdir()
    env = {"READY_DIR": str(ready), "SAVED_DIR": str(saved), "CLEANUP_S": "1.5"}
    args = ["--num_gpus", "2", "--grace_period", grace, "--master_port", str(free_port())]
    result = run_dslaunch([*args, str(SCRIPTS / "term_cleanup.py")], env, timeout=60)
    return result, saved


@pytest.mark.timeout(90)
def test_survivors_get_the_whole_grace_period_after_a_worker_fails(tmp_path):
    # Rank 1 exits 7; rank 0 needs 1.5 s on SIGTERM. It used to be SIGKILLed ~20 ms after SIGTERM: the
    # head's stop reached an agent already stopping and counted as a second request.
    result, saved = _grace_job(tmp_path, "5")
    assert result.returncode == 7, result.stderr
    assert (saved / "0").read_text() == "saved\n"
    assert "FAILED: rank 1 (local rank 1) on localhost exited with code 7" in result.stderr
    assert "rank 1 is failing now" in result.stderr.split("FAILED:")[1]


@pytest.mark.timeout(90)
def test_a_survivor_outlasting_the_grace_period_is_killed_and_the_first_failure_still_named(tmp_path):
    result, saved = _grace_job(tmp_path, "0.5")
    assert result.returncode == 7, result.stderr
    assert list(saved.iterdir()) == []  # killed 0.5 s into its 1.5 s clean-up
    assert "FAILED: rank 1 (local rank 1) on localhost exited with code 7" in result.stderr
    assert "also:" not in result.stderr  # rank 0's SIGKILL is a consequence, not a failure


@pytest.mark.ssh
@pytest.mark.timeout(180)
def test_survivors_on_every_node_get_the_grace_period(sshd_hosts: Testbed, tmp_path: Path) -> None:
    # Rank 3 fails on worker2: rank 2 is stopped by worker2's agent (which then also gets the head's
    # stop), ranks 0-1 by worker1's agent on the head's stop; each needs 1.5 s of its 5 s grace.
    saved, ready = tmp_path / "saved", tmp_path / "ready"
    saved.mkdir()
    ready.mkdir()
    script = tmp_path / "term_cleanup.py"  # in the test's directory, which every fake host sees
    script.write_text((SCRIPTS / "term_cleanup.py").read_text())
    env = [f"READY_DIR={ready}", f"SAVED_DIR={saved}", "FAIL_RANK=3", "CLEANUP_S=1.5"]
    args = ["--hostfile", str(sshd_hosts.hostfile), "--ssh_config", str(sshd_hosts.ssh_config),
            "--master_port", str(free_port()), "--grace_period", "5"]  # fmt: skip
    result = run_dslaunch([*args, *[a for e in env for a in ("--env", e)], str(script)], timeout=120)
    assert result.returncode == 7, result.stderr
    assert "FAILED: rank 3 (local rank 1) on worker2 exited with code 7" in result.stderr
    assert sorted(p.name for p in saved.iterdir()) == ["0", "1", "2"]


def _error_job(tmp_path: Path, n: int, env: dict[str, str]):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    logs = tmp_path / "logs"
    args = ["--num_gpus", str(n), "--master_port", str(free_port()), "--log_dir", str(logs)]
    result = run_dslaunch([*args, str(SCRIPTS / "error_file.py")], {"BARRIER_DIR": str(barrier), **env})
    return result, logs


@pytest.mark.timeout(90)
def test_ranks_failing_the_same_way_are_one_line_with_the_hint_and_the_traceback_in_their_logs(tmp_path):
    msg = "ConfigError: unknown key 'zero_optimisation' in ds.json"
    env = {"FAIL_RANKS": "0,1,2", "FAIL_MESSAGE": msg, "FAIL_KIND": "user_input",
           "FAIL_HINT": "did you mean 'zero_optimization'?", "FAIL_CODE": "2"}  # fmt: skip
    result, logs = _error_job(tmp_path, 4, env)
    assert result.returncode == 2, result.stderr
    summary = result.stderr[result.stderr.index("dslaunch: ranks") :].splitlines()
    assert summary == [
        f"dslaunch: ranks 0-2 failed the same way (exit code 2): {msg}",
        "dslaunch:   hint: did you mean 'zero_optimization'?",
    ]
    assert "Traceback" not in result.stderr and "last " not in result.stderr  # user input: no tail
    for rank in (0, 1, 2):
        log = (logs / f"rank_{rank}.log").read_text()
        assert log.startswith(f"rank {rank} is failing now\n")
        assert "traceback from the worker's error file" in log and f"ValueError: {msg}" in log
    assert "Traceback" not in (logs / "rank_3.log").read_text()  # stopped, not failed


@pytest.mark.timeout(90)
def test_ranks_failing_differently_are_not_folded(tmp_path):
    env = {"FAIL_RANKS": "0,1", "FAIL_MESSAGE": "ValueError: shard {rank} is corrupt", "FAIL_CODE": "1"}
    result, _ = _error_job(tmp_path, 3, env)
    assert result.returncode == 1, result.stderr
    assert "failed the same way" not in result.stderr
    lines = result.stderr.splitlines()
    heads = [ln for ln in lines if "exited with code 1: ValueError" in ln]
    assert len(heads) == 2, result.stderr
    first, other = sorted(heads, key=lambda ln: "also:" in ln)
    assert first.startswith("dslaunch: FAILED: rank ") and other.startswith("dslaunch: also: rank ")
    for rank in (0, 1):
        assert sum(f"rank {rank} (local rank {rank}) on localhost exited with code 1: ValueError: "
                   f"shard {rank} is corrupt" in ln for ln in heads) == 1  # fmt: skip
    assert "the first failure of attempt 0" in result.stderr  # not user input: today's detail stays


@pytest.mark.timeout(120)
def test_a_script_using_torchs_record_reports_through_the_same_file(tmp_path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    logs = tmp_path / "logs"
    args = ["--num_gpus", "2", "--master_port", str(free_port()), "--log_dir", str(logs)]
    result = run_dslaunch(
        [*args, str(SCRIPTS / "record_error.py")], {"BARRIER_DIR": str(barrier)}, timeout=100
    )
    assert result.returncode == 1, result.stderr
    msg = "ValueError: shard 3 of data/train.bin is corrupt"
    assert f"dslaunch: ranks 0-1 failed the same way (exit code 1): {msg}\n" in result.stderr
    for rank in (0, 1):
        log = (logs / f"rank_{rank}.log").read_text()
        assert log.count(f"\n{msg}\n") == 2  # Python's traceback, then the one from the error file
