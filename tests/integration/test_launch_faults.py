"""dslaunch when workers fail, end to end with real processes: the survivors' grace period, and the
failure summary built from the workers' error files (folded when ranks fail the same way)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.plan import HostSlots, JobConfig, make_plan
from launcher.runners import get_runner
from launcher.runners.base import RunnerOptions
from launcher.supervisor import SuperviseOptions, run_job
from tests.support.dist import free_port
from tests.support.launching import CPU, DSLAUNCH, REPO, SCRIPTS, run_dslaunch
from tests.support.sshd_testbed import Testbed


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


@pytest.mark.timeout(120)
def test_a_rank_that_only_lost_its_peer_is_a_consequence_of_the_real_failure(tmp_path):
    # Rank 1 closes its gloo connections and raises 1.5 s later: rank 0's "Connection closed by peer"
    # reaches the head first. It used to be named the root cause, and rank 1's error came as "also:".
    env = {"FAIL_RANK": "1", "LATE": "1"}
    args = ["--num_gpus", "2", "--master_port", str(free_port())]
    result = run_dslaunch([*args, str(SCRIPTS / "peer_fails.py")], env, timeout=100)
    assert result.returncode == 1, result.stderr
    summary = result.stderr[result.stderr.index("dslaunch: FAILED") :].splitlines()
    assert summary[0] == (
        "dslaunch: FAILED: rank 1 (local rank 1) on localhost exited with code 1: "
        "ValueError: shard 1 of data/train.bin is corrupt"
    )
    lost = "gloo: (Connection closed by peer|Connection reset by peer|Broken pipe)"  # as the peer left
    assert re.fullmatch(
        f"dslaunch: rank 0: lost its peer \\({lost}\\) -- a consequence of rank 1's failure", summary[-1]
    )
    assert not any(line.startswith("dslaunch: also:") for line in summary)


@pytest.mark.timeout(120)
def test_a_rank_that_exited_0_while_its_peers_ran_collectives_is_named_as_the_peer_they_lost(tmp_path):
    # Rank 1 returns after the first all-reduce; rank 0's next one fails with "Connection closed by peer".
    # The hint used to blame something outside the job (the OOM killer, the network).
    args = ["--num_gpus", "2", "--master_port", str(free_port())]
    result = run_dslaunch(
        [*args, str(SCRIPTS / "peer_fails.py")], {"FAIL_RANK": "1", "FINISH": "1"}, timeout=100
    )
    assert result.returncode == 1, result.stderr
    summary = result.stderr[result.stderr.index("dslaunch: FAILED") :].splitlines()
    assert summary[0].startswith("dslaunch: FAILED: rank 0 (local rank 0) on localhost exited with code 1")
    assert summary[-1] == (
        "dslaunch:   hint: rank 1 had already exited with code 0 while the others still ran collectives "
        "with it: every rank must reach the same collectives (a branch on the rank, an early return or "
        "sys.exit(0), more data on some ranks than on others?)"
    )


@pytest.mark.timeout(60)
def test_a_huge_last_line_without_a_newline_is_cut_in_the_summary(tmp_path):
    script = tmp_path / "huge.py"
    script.write_text(
        'import sys\nsys.stdout.write("x" * 1_000_000 + " the end")\nsys.stdout.flush()\nsys.exit(5)\n'
    )
    result = run_dslaunch(["--num_gpus", "1", str(script)])
    assert result.returncode == 5, result.stderr
    assert len(result.stdout) > 1_000_000  # the console still gets all of it
    summary = result.stderr[result.stderr.index("dslaunch: FAILED") :]
    assert len(summary.encode()) < 5000, summary[:300]  # was about 1 MB
    head = summary.splitlines()[2]
    assert head.startswith("dslaunch:   last ") and " more bytes cut; the whole output is above" in head
    assert summary.rstrip().endswith("x the end")  # the end of the line survives the cut
    assert "bytes cut ...] " in summary


def _leftovers_job(tmp_path: Path, how: str, extra: dict[str, str]):
    pids = tmp_path / "pids"
    pids.mkdir()
    args = ["--num_gpus", "2", "--grace_period", "0.5", "--master_port", str(free_port())]
    result = run_dslaunch(
        [*args, str(SCRIPTS / "leave_daemon.py")], {"PID_DIR": str(pids), "HOW": how, **extra}
    )
    daemons = [int(f.read_text()) for f in pids.iterdir() if not f.name.endswith(".tmp")]
    alive = [pid for pid in daemons if Path(f"/proc/{pid}").exists()]
    for pid in alive:  # clean up after a failing test
        os.kill(pid, signal.SIGKILL)
    return result, daemons, alive


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("how", "outcome", "stubborn"),
    [("double_fork", "success", False), ("setsid", "failure", False), ("setsid", "success", True)],
)
def test_no_process_started_by_the_job_outlives_it(tmp_path, how, outcome, stubborn):
    # Each rank starts a daemon in its own session (a double-forked orphan, or a setsid child of a rank
    # still running when rank 1 fails): the stop of the worker groups never reached them, they lived on.
    # A stubborn one (SIGTERM ignored) is killed after the grace period, and reaped, not left a zombie.
    extra = {"FAIL_RANK": "1", "STAY": "1"} if outcome == "failure" else {}
    result, daemons, alive = _leftovers_job(tmp_path, how, {**extra, "STUBBORN": str(int(stubborn))})
    assert result.returncode == (3 if outcome == "failure" else 0), result.stderr
    assert len(daemons) == 2 and alive == [], result.stderr
    ended = next(line for line in result.stderr.splitlines() if line.startswith("dslaunch: ended"))
    assert ended.startswith("dslaunch: ended 2 processes left behind by the job (2 on localhost): ")
    assert ended.endswith(f"sleep(1000) {SCRIPTS / 'leave_daemon.py'}")  # each command on the one line


@pytest.mark.timeout(60)
def test_ctrl_c_ends_the_daemons_of_a_running_job_too(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, **CPU, "PID_DIR": str(pids), "HOW": "setsid", "STAY": "1"}
    args = ["--num_gpus", "2", "--grace_period", "2", "--master_port", str(free_port())]
    argv = [*DSLAUNCH, *args, str(SCRIPTS / "leave_daemon.py")]
    proc = subprocess.Popen(
        argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while len([f for f in pids.iterdir() if not f.name.endswith(".tmp")]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    daemons = [int(f.read_text()) for f in pids.iterdir() if not f.name.endswith(".tmp")]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    alive = [pid for pid in daemons if Path(f"/proc/{pid}").exists()]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert len(daemons) == 2 and alive == [], err
    assert "dslaunch: ended 2 processes left behind by the job (2 on localhost): " in err


@pytest.mark.timeout(60)
def test_ranks_still_running_long_after_others_exited_0_get_one_note(tmp_path):
    # Rank 0 exits 0 at once, rank 1 runs on (as a rank waiting in a collective for it would, silently,
    # until NCCL's timeout): one note names both, after finished_note_s; the job still succeeds.
    script = tmp_path / "uneven.py"
    script.write_text('import os, time\nif os.environ["RANK"] == "1":\n    time.sleep(2.5)\n')
    job = JobConfig(script=str(script), python=sys.executable, master_port=free_port(), cwd=str(tmp_path))
    plan = make_plan([HostSlots("localhost", (0, 1), gpus=False, local=True)], job, 0)
    said: list[str] = []
    runner = get_runner("local")(RunnerOptions(python=sys.executable, grace_period=1.0))
    code = run_job(lambda _: plan, runner, SuperviseOptions(finished_note_s=1.0), said.append)
    assert code == 0, said
    notes = [line for line in said if "exited with code 0" in line]
    assert len(notes) == 1 and re.fullmatch(
        r"rank\(s\) 0 exited with code 0 \d s ago and rank\(s\) 1 still run: if those wait in a collective "
        r"for the finished ones, they wait until its timeout; every rank must reach the same collectives "
        r"\(Ctrl-C stops the job\)",
        notes[0],
    ), said


@pytest.mark.timeout(60)
def test_a_rank_stopped_while_exiting_after_its_own_error_is_not_called_killed(tmp_path):
    # Rank 1 fails; rank 0 has raised its own error (the error file is written) and is still exiting (an
    # atexit handler) when the stop reaches it. It was listed as "was killed by SIGKILL (exit code 137);
    # out of memory?", a victim, with its own error after that.
    script = tmp_path / "both_fail.py"
    script.write_text(
        "import atexit, os, signal, time\n"
        "if os.environ['RANK'] == '0':\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "    atexit.register(time.sleep, 10)\n"
        "import runtime\n"
        "from runtime.errors import UserError\n"
        "time.sleep(1.5 if os.environ['RANK'] == '0' else 0)\n"
        "raise UserError(f\"shard {os.environ['RANK']} is corrupt\")\n"
    )
    args = ["--num_gpus", "2", "--grace_period", "3", "--master_port", str(free_port()), str(script)]
    result = run_dslaunch(args, timeout=50)
    assert result.returncode == 2, result.stderr
    lines = [
        line for line in result.stderr.splitlines() if line.startswith(("dslaunch: FAILED", "dslaunch: also"))
    ]
    assert lines == [
        "dslaunch: FAILED: rank 1 (local rank 1) on localhost exited with code 2: shard 1 is corrupt",
        "dslaunch: also: rank 0 (local rank 0) on localhost failed as well (the stop reached it while it "
        "exited: exit code 137): shard 0 is corrupt",
    ], result.stderr
