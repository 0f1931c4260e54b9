"""dslaunch across hosts, end to end, against real sshd servers (tests/support/sshd_testbed.py): real gloo
groups, real signals, real SSH failures. No mocks.

Every job's worker script lives in the test's tmp dir, so its path is a marker: a process whose command
line contains it belongs to this test's job, on whichever host, in whichever namespace. Workers also
start a child in its own session, outside their process group (it must not outlive the job either).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import sshd_testbed
from tests.support.launching import DSLAUNCH, REPO, SCRIPTS
from tests.support.multinode import REPORT_WORKER, base_args, job_env, run_dslaunch, worker
from tests.support.sshd_testbed import Testbed, find_processes

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(180)]

SLEEP_WORKER = """
import os, subprocess, sys, time
sleeper = [sys.executable, "-c", "import time; time.sleep(300)", __file__]
child = subprocess.Popen(sleeper, start_new_session=True)
rank = os.environ["RANK"]
print(f"ready {rank}", flush=True)
if rank == os.environ.get("FAIL_RANK"):
    time.sleep(0.5)
    print(f"rank {rank} is failing now", flush=True)
    sys.exit(int(os.environ["FAIL_CODE"]))
if os.environ.get("READY_DIR"):  # a directory every host sees: wait for the whole job to be up
    ready = os.path.join(os.environ["READY_DIR"], os.environ["DSLAUNCH_ATTEMPT"])
    os.makedirs(ready, exist_ok=True)
    open(os.path.join(ready, rank), "w").close()
    while len(os.listdir(ready)) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.05)
if rank == os.environ.get("FAIL_RANK_ON_FIRST_ATTEMPT") and os.environ["DSLAUNCH_ATTEMPT"] == "0":
    sys.exit(5)
if os.environ.get("SLEEP") == "0":
    sys.exit(0)
time.sleep(300)
"""


def start_dslaunch(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    # Own session: the test's signals reach dslaunch only, as a terminal's would reach the foreground job.
    return subprocess.Popen([*DSLAUNCH, *args], env=env or job_env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip


def wait_ready(proc: subprocess.Popen, n: int, timeout: float = 60) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while sum("] ready " in ln for ln in lines) < n:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise AssertionError(f"workers not ready: {lines} {proc.stderr.read() if proc.poll() else ''}")
        lines.append(proc.stdout.readline())
    return lines


def job_processes(tb: Testbed, marker: str) -> dict[str, list[str]]:
    """This job's processes, per host (namespace mode) and anywhere on the machine."""
    found = {name: [p.cmdline for p in tb.processes(name) if marker in p.cmdline] for name in tb.names}
    found["anywhere"] = [p.cmdline for p in find_processes(marker)]
    return {k: v for k, v in found.items() if v}


def wait_no_job_processes(tb: Testbed, marker: str, timeout: float) -> float:
    start = time.monotonic()
    while job_processes(tb, marker):
        if time.monotonic() - start > timeout:
            raise AssertionError(f"left behind after {timeout}s: {job_processes(tb, marker)}")
        time.sleep(0.1)
    return time.monotonic() - start


def reports(stdout: str) -> dict[str, dict]:
    """label ("worker1 rank 0") -> the worker's REPORT."""
    return {m[1]: json.loads(m[2]) for m in re.finditer(r"^\[([^\]]+)\] REPORT (.*)$", stdout, re.M)}


# --- the job runs everywhere with the right identity and environment ----------------------------------


def check_four_rank_reports(tb: Testbed, stdout: str) -> dict[str, dict]:
    got = reports(stdout)
    assert sorted(got) == ["worker1 rank 0", "worker1 rank 1", "worker2 rank 2", "worker2 rank 3"], stdout
    for label, r in got.items():
        host, rank = label.split(" rank ")
        env = r["env"]
        assert r["sum"] == 0 + 1 + 2 + 3
        assert env["RANK"] == rank and env["WORLD_SIZE"] == "4"
        assert env["LOCAL_RANK"] == str(int(rank) % 2)
        assert env["NODE_RANK"] == str(int(rank) // 2)
        assert env["MASTER_ADDR"] == tb.host("worker1").address  # what worker2 reaches worker1 by
        assert r["host"] == tb.hostname_of(host)  # it really ran on that host
        assert r["argv"] == [f"--local_rank={env['LOCAL_RANK']}", "--flag"]
    return got


def test_four_ranks_on_two_hosts(sshd_hosts: Testbed, tmp_path: Path) -> None:
    script = worker(tmp_path, REPORT_WORKER)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".dslaunch_env").write_text("# per-user settings\nDSL_FROM_FILE='from the env file'\n")
    tricky = """spaces, 'single' "double" $HOME `cmd` ; done"""
    env = job_env(HOME=str(home), NCCL_DEBUG="WARN", PATH_LIKE="not forwarded")
    logs = tmp_path / "logs"
    r = run_dslaunch([*base_args(sshd_hosts), "--log_dir", str(logs), "--env", f"DSL_TEST_VAR={tricky}",
                      str(script), "--flag"], env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = check_four_rank_reports(sshd_hosts, r.stdout)
    for rep in got.values():
        assert rep["env"]["DSL_TEST_VAR"] == tricky  # --env: intact through SSH
        assert rep["env"]["NCCL_DEBUG"] == "WARN"  # forwarded by prefix
        assert rep["env"]["DSL_FROM_FILE"] == "from the env file"  # ~/.dslaunch_env
    assert all(rep["env"]["PATH_LIKE"] is None for rep in got.values())  # not forwarded
    assert "remote workers also get" in r.stderr and "NCCL_DEBUG" in r.stderr and "WARN" not in r.stderr
    # Per-rank logs on the head, remote ranks included.
    for rank in range(4):
        assert "REPORT " in (logs / f"rank_{rank}.log").read_text()


@pytest.mark.parametrize("launcher", ["pdsh", "openmpi"])
def test_four_ranks_through_pdsh_and_mpirun(sshd_hosts: Testbed, tmp_path: Path, launcher: str) -> None:
    tool = {"pdsh": "pdsh", "openmpi": "mpirun"}[launcher]
    if subprocess.run(["which", tool], capture_output=True).returncode != 0:
        pytest.skip(f"{tool} not installed (scripts/install_system_deps.sh installs it)")
    script = worker(tmp_path, REPORT_WORKER)
    tricky = "a b'c\"$d"
    r = run_dslaunch([*base_args(sshd_hosts), "--launcher", launcher, "--env", f"DSL_TEST_VAR={tricky}",
                      str(script), "--flag"])  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = check_four_rank_reports(sshd_hosts, r.stdout)
    assert all(rep["env"]["DSL_TEST_VAR"] == tricky for rep in got.values())


# --- stopping: everything of this job, nothing else -----------------------------------------------------


def test_a_failure_on_host2_stops_both_hosts(sshd_hosts: Testbed, tmp_path: Path) -> None:
    script = worker(tmp_path, SLEEP_WORKER)
    t0 = time.monotonic()
    fail = ["--env", "FAIL_RANK=3", "--env", "FAIL_CODE=3"]  # --env: the head's own env stays home
    r = run_dslaunch([*base_args(sshd_hosts), *fail, str(script)])
    assert r.returncode == 3, r.stderr
    assert time.monotonic() - t0 < 30  # not the workers' 300 s sleep
    assert "FAILED: rank 3 (local rank 1) on worker2 exited with code 3" in r.stderr
    assert "rank 3 is failing now" in r.stderr  # the tail of the failing rank
    assert job_processes(sshd_hosts, str(script)) == {}


def test_max_restarts_restarts_every_host(sshd_hosts: Testbed, tmp_path: Path) -> None:
    script = worker(tmp_path, SLEEP_WORKER)
    env = ["--env", "FAIL_RANK_ON_FIRST_ATTEMPT=3", "--env", "SLEEP=0", "--env", f"READY_DIR={tmp_path}"]
    r = run_dslaunch([*base_args(sshd_hosts), "--max_restarts", "1", *env, str(script)])
    assert r.returncode == 0, r.stderr
    assert "restarting all workers (restart 1 of 1)" in r.stderr
    for rank in range(4):  # every rank ran in both attempts, on both hosts
        assert r.stdout.count(f"rank {rank}] ready {rank}") == 2, r.stdout


def test_sigint_stops_this_job_only(sshd_hosts: Testbed, tmp_path: Path) -> None:
    script = worker(tmp_path, SLEEP_WORKER)
    # Someone else's job on worker2, whose command line looks like ours: a pkill -f pattern would hit it.
    bystander = sshd_hosts.spawn_detached(
        "worker2", [sys.executable, "-c", "import time; time.sleep(600)", "-m", "launcher.agent", "bystander"]
    )
    try:
        proc = start_dslaunch([*base_args(sshd_hosts), str(script)])
        wait_ready(proc, 4)
        assert set(job_processes(sshd_hosts, str(script))) >= {"anywhere"}
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert job_processes(sshd_hosts, str(script)) == {}
        assert Path(f"/proc/{bystander}").exists(), "an unrelated process on worker2 was killed"
    finally:
        os.kill(bystander, signal.SIGKILL)


def test_sigkill_of_dslaunch_still_stops_every_worker(sshd_hosts: Testbed, tmp_path: Path) -> None:
    script = worker(tmp_path, SLEEP_WORKER)
    proc = start_dslaunch([*base_args(sshd_hosts), str(script)])
    wait_ready(proc, 4)
    proc.kill()  # no handler runs: only the SSH channel closing (the lifeline) can stop the remote agents
    proc.wait()
    took = wait_no_job_processes(sshd_hosts, str(script), timeout=15)
    assert took < 15


@pytest.mark.parametrize("outcome", ["success", "failure"])
def test_no_process_started_by_the_job_outlives_it_on_any_host(
    sshd_hosts: Testbed, tmp_path: Path, outcome: str
) -> None:
    # Every rank leaves a double-forked daemon in its own session (its command line names the script):
    # the remote agents adopt them as subreapers and end them with the job; they used to live on.
    script = worker(tmp_path, (SCRIPTS / "leave_daemon.py").read_text(), "leave_daemon.py")
    pids = tmp_path / "pids"
    pids.mkdir()
    env = [f"PID_DIR={pids}", "HOW=double_fork", *(["FAIL_RANK=3", "STAY=1"] if outcome == "failure" else [])]
    r = run_dslaunch([*base_args(sshd_hosts), *[a for e in env for a in ("--env", e)], str(script)])
    assert r.returncode == (3 if outcome == "failure" else 0), r.stderr
    assert len(list(pids.iterdir())) == 4  # every rank did start its daemon
    assert job_processes(sshd_hosts, str(script)) == {}
    assert "dslaunch: ended 4 processes left behind by the job (2 on worker1, 2 on worker2): " in r.stderr


# --- a host that cannot be used: a clear cause, and nothing starts anywhere ------------------------------


@pytest.fixture(scope="module")
def troubled(sshd_testbed_factory) -> Testbed:
    """worker1 healthy, worker2 healthy (for the key tests), worker3 with a new host key, worker4 down."""
    tb = sshd_testbed_factory(4, 1)
    tb.regenerate_host_key("worker3")
    tb.stop_host("worker4")
    return tb


def _known_hosts_without(tb: Testbed, name: str, path: Path) -> Path:
    h = tb.host(name)
    lines = [ln for ln in tb.known_hosts.read_text().splitlines(True) if f"[{h.address}]:{h.port}" not in ln]
    path.write_text("".join(lines))
    return path


@pytest.mark.parametrize("case", ["unknown host key", "host key changed", "sshd stopped", "wrong user key"])
def test_unusable_host_starts_nothing(troubled: Testbed, tmp_path: Path, case: str) -> None:
    script = worker(tmp_path, "open(__file__ + '.ran', 'w').close()\n")
    cfg, bad = troubled.ssh_config, "worker2"
    if case == "unknown host key":
        kh = _known_hosts_without(troubled, "worker2", tmp_path / "kh")
        cfg = troubled.write_ssh_config(tmp_path / "cfg", known_hosts=kh)
        expect = ["unknown host key", "ssh-keyscan -p", "--accept_new_host_keys"]
    elif case == "host key changed":
        bad, expect = "worker3", ["host key changed", "ssh-keygen -f", " -R "]
    elif case == "sshd stopped":
        bad, expect = "worker4", ["connection refused", "nothing listens on 127.0.0.5"]
    else:
        sshd_testbed.keygen(tmp_path / "stranger", "stranger")
        cfg = troubled.write_ssh_config(tmp_path / "cfg", identity=tmp_path / "stranger")
        expect = ["authentication failed", str(tmp_path / "stranger"), "authorized_keys"]
    hostfile = troubled.write_hostfile(tmp_path / "hostfile", hosts=["worker1", bad])
    r = run_dslaunch([*base_args(troubled, hostfile, cfg), str(script)], timeout=60)
    assert r.returncode == 2, r.stderr
    assert "nothing was started" in r.stderr
    line = next((ln for ln in r.stderr.splitlines() if ln.strip().startswith(bad)), r.stderr)
    msg = r.stderr[r.stderr.index(line) :]
    assert all(e in msg for e in expect), r.stderr
    assert "Traceback" not in r.stderr
    assert not Path(f"{script}.ran").exists()  # not even on the healthy worker1


def test_a_missing_ssh_config_is_a_one_line_error(sshd_hosts: Testbed, tmp_path: Path) -> None:
    r = run_dslaunch([*base_args(sshd_hosts, ssh_config=tmp_path / "nope"), "x.py"], timeout=60)
    assert r.returncode == 2
    assert f"ssh config file not found: {tmp_path / 'nope'}" in r.stderr and "Traceback" not in r.stderr


def test_hostfile_may_name_user_address_and_port(sshd_hosts: Testbed, tmp_path: Path) -> None:
    # No ssh_config alias needed: user@address:port straight from the hostfile (keys from "Host *").
    script = worker(tmp_path, SLEEP_WORKER)
    w1, w2 = sshd_hosts.host("worker1"), sshd_hosts.host("worker2")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"root@{w1.address}:{w1.port} slots=1\nroot@{w2.address}:{w2.port} slots=1\n")
    r = run_dslaunch([*base_args(sshd_hosts, hostfile), "--env", "SLEEP=0", str(script)])
    assert r.returncode == 0, r.stderr
    assert f"[root@{w2.address}:{w2.port} rank 1] ready 1" in r.stdout


def test_accept_new_host_keys_is_an_explicit_opt_in(troubled: Testbed, tmp_path: Path) -> None:
    script = worker(tmp_path, "open(__file__ + '.ran', 'a').close()\n")
    kh = _known_hosts_without(troubled, "worker2", tmp_path / "kh")
    cfg = troubled.write_ssh_config(tmp_path / "cfg", known_hosts=kh)
    hostfile = troubled.write_hostfile(tmp_path / "hostfile", hosts=["worker1", "worker2"])
    args = [*base_args(troubled, hostfile, cfg), str(script)]
    assert run_dslaunch(args, timeout=60).returncode == 2  # the default refuses
    r = run_dslaunch(["--accept_new_host_keys", *args], timeout=60)
    assert r.returncode == 0, r.stderr
    w2 = troubled.host("worker2")
    assert f"[{w2.address}]:{w2.port} {w2.host_key_pub.read_text().split()[0]}" in kh.read_text()
    assert Path(f"{script}.ran").exists()
