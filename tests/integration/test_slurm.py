"""``dslaunch --launcher slurm`` against a real Slurm: munged, slurmctld and two slurmd nodes that this
session starts on this machine (tests/support/slurm_testbed.py), real salloc/sbatch/srun/scancel, real gloo.

The hostfiles list node2 before node1, the reverse of Slurm's own order, so a rank on the wrong node
shows. The node names do not resolve, hence ``--master_addr 127.0.0.1``. Every job's worker script
lives in the test's tmp dir: a process whose command line holds that path belongs to the job.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from launcher.errors import LaunchError
from launcher.plan import HostSlots, JobConfig, make_plan
from launcher.runners.slurm import gpu_request
from tests.support import slurm_testbed
from tests.support.dist import free_port
from tests.support.slurm_testbed import Cluster

pytestmark = pytest.mark.timeout(120)

DSLAUNCH = [sys.executable, "-m", "launcher.cli", "--launcher", "slurm"]

ALLREDUCE_WORKER = """
import json, os
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("REPORT " + json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
      "node": os.environ.get("SLURMD_NODENAME"), "cpus": len(os.sched_getaffinity(0))}), flush=True)
dist.destroy_process_group()
"""

# Waits until every rank is up (files in READY_DIR, which holds each rank's pid and its child's), then:
# FAIL_RANK exits 7; the others sleep, and on SIGTERM take CLEANUP_S (1 s) to clean up and say so.
SLEEP_WORKER = """
import os, signal, subprocess, sys, time
rank = os.environ["RANK"]
def cleanup(signum, frame):
    time.sleep(float(os.environ.get("CLEANUP_S", "1")))
    print(f"rank {rank} cleaned up after {signal.Signals(signum).name}", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, cleanup)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", __file__])
ready = os.environ["READY_DIR"]
with open(os.path.join(ready, rank + ".tmp"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.rename(os.path.join(ready, rank + ".tmp"), os.path.join(ready, rank))
while len([n for n in os.listdir(ready) if n.isdigit()]) < int(os.environ["WORLD_SIZE"]):
    time.sleep(0.05)
# one write with its newline: the test's signal may come while this prints, and the handler's line must
# not be glued to a "ready" that lost its end (print writes the text and its end apart)
print(f"ready {rank}\\n", end="", flush=True)
if rank == os.environ.get("FAIL_RANK"):
    sys.exit(7)
time.sleep(300)
"""

# Rank 0 works on for 3 s after rank 1 finished: the job must wait for it (a site's WaitTime of 2 s
# must not cut it short).
UNEVEN_WORKER = """
import os, time
done = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank1.done")
if os.environ["RANK"] == "0":
    while not os.path.exists(done):
        time.sleep(0.05)
    time.sleep(3)
print("rank", os.environ["RANK"], "finished", flush=True)
if os.environ["RANK"] == "1":
    open(done, "w").close()
"""

ENV_WORKER = """
import os
print("NODE", os.environ.get("SLURMD_NODENAME"), os.environ["RANK"], os.environ["WORLD_SIZE"],
      "step-gpus=" + os.environ.get("SLURM_STEP_GPUS", "none"), flush=True)
"""


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = slurm_testbed.unavailable_reason()
    if reason:
        pytest.skip(reason)
    try:
        cluster = slurm_testbed.start(tmp_path_factory.mktemp("slurm"), n_nodes=2)
    except slurm_testbed.SlurmUnavailable as e:
        pytest.skip(f"a one-machine Slurm does not start here: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()


def job_env(cluster: Cluster, tmp_path: Path, **extra: str) -> dict[str, str]:
    tmpdir = tmp_path / "tmpdir"  # dslaunch's own temporary files land here, so a test can look
    tmpdir.mkdir(exist_ok=True)
    return {**cluster.env, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TMPDIR": str(tmpdir), **extra}


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def dslaunch_args(hostfile: Path, script: Path, *extra: str) -> list[str]:
    return [*DSLAUNCH, "--hostfile", str(hostfile), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), *extra, str(script)]  # fmt: skip


def salloc(cluster: Cluster, tmp_path: Path, alloc: list[str], argv: list[str], **extra: str):
    """Run ``argv`` inside a new allocation (salloc's options ``alloc``); returns its result."""
    env = job_env(cluster, tmp_path, **extra)
    cmd = ["salloc", "--quiet", *alloc, *argv]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)


def sbatch(cluster: Cluster, tmp_path: Path, args: list[str], argv: list[str], **extra: str):
    """Submit ``argv`` as a batch script (output in tmp_path/job.out); returns sbatch's result."""
    cmd = ["sbatch", "--parsable", "-o", str(tmp_path / "job.out"), f"--chdir={tmp_path}", *args,
           "--wrap", shlex.join(argv)]  # fmt: skip
    env = job_env(cluster, tmp_path, **extra)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)


def wait_ready(ready: Path, n: int, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> list[int]:
    """The pids (workers and their children) once ``n`` ranks are up."""
    deadline = time.monotonic() + timeout
    while len([p for p in ready.iterdir() if p.name.isdigit()]) < n:
        assert proc is None or proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"ranks not up after {timeout} s"
        time.sleep(0.05)
    return [int(pid) for p in ready.iterdir() if p.name.isdigit() for pid in p.read_text().split()]


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def job_processes(marker: Path) -> list[str]:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and str(marker) in " ".join(p.info["cmdline"] or ()):
            found.append(f"{p.pid} {' '.join(p.info['cmdline'])}")
    return found


def test_two_nodes_allreduce_in_hostfile_order(slurm: Cluster, tmp_path: Path) -> None:
    hosts = write(tmp_path, "hosts", "node2 slots=1\nnode1 slots=1\n")
    script = write(tmp_path, "allreduce.py", ALLREDUCE_WORKER)
    alloc = ["-N2", f"--ntasks-per-node={slurm.cpus}"]
    res = salloc(slurm, tmp_path, alloc, dslaunch_args(hosts, script))
    assert res.returncode == 0, res.stdout + res.stderr
    reports = {}
    for line in res.stdout.splitlines():
        prefix, _, payload = line.partition("REPORT ")
        if payload:
            r = json.loads(payload)
            reports[r["rank"]] = r
            assert prefix == f"[{r['node']} rank {r['rank']}] "
    assert sorted(reports) == [0, 1], res.stdout + res.stderr
    assert [reports[r]["sum"] for r in (0, 1)] == [3.0, 3.0]  # 1 + 2 over gloo
    assert [reports[r]["node"] for r in (0, 1)] == ["node2", "node1"]  # the hostfile's order
    assert [reports[r]["world"] for r in (0, 1)] == [2, 2]
    # The agent's step must not pin the node's workers to one CPU of the allocation.
    assert [reports[r]["cpus"] for r in (0, 1)] == [slurm.cpus, slurm.cpus]
    assert list((tmp_path / "tmpdir").iterdir()) == []  # srun's host list is removed after the job


def test_failing_rank_stops_the_job_with_its_code(slurm: Cluster, tmp_path: Path) -> None:
    hosts = write(tmp_path, "hosts", "node2 slots=1\nnode1 slots=1\n")
    script = write(tmp_path, "worker.py", SLEEP_WORKER)
    (tmp_path / "ready").mkdir()
    t0 = time.monotonic()
    res = salloc(slurm, tmp_path, ["-N2"], dslaunch_args(hosts, script, "--grace_period", "5"),
                 READY_DIR=str(tmp_path / "ready"), FAIL_RANK="1")  # fmt: skip
    elapsed = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.returncode == 7, out
    assert "dslaunch: FAILED: rank 1 (local rank 0) on node1 exited with code 7" in res.stderr, out
    # The survivor on the other node got SIGTERM and its grace period, not Slurm's SIGKILL.
    assert "[node2 rank 0] rank 0 cleaned up after SIGTERM" in res.stdout, out
    assert elapsed < 30, out
    assert job_processes(script) == []


def test_ctrl_c_gives_every_worker_its_grace_period(slurm: Cluster, tmp_path: Path) -> None:
    hosts = write(tmp_path, "hosts", "node2 slots=1\nnode1 slots=1\n")
    script = write(tmp_path, "worker.py", SLEEP_WORKER)
    ready = tmp_path / "ready"
    ready.mkdir()
    argv = ["salloc", "--quiet", "-N2", *dslaunch_args(hosts, script, "--grace_period", "5")]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=job_env(slurm, tmp_path, READY_DIR=str(ready)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_ready(ready, 2, proc)
        (head,) = [c for c in psutil.Process(proc.pid).children() if "launcher.cli" in " ".join(c.cmdline())]
        head.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, out + err
    for rank, node in ((0, "node2"), (1, "node1")):
        assert f"[{node} rank {rank}] rank {rank} cleaned up after SIGTERM" in out, out + err
    assert "dslaunch: interrupted: all workers stopped (exit 130)" in err
    assert job_processes(script) == []


def test_a_second_ctrl_c_kills_at_once(slurm: Cluster, tmp_path: Path) -> None:
    hosts = write(tmp_path, "hosts", "node2 slots=1\nnode1 slots=1\n")
    script = write(tmp_path, "worker.py", SLEEP_WORKER)
    ready = tmp_path / "ready"
    ready.mkdir()
    argv = ["salloc", "--quiet", "-N2", *dslaunch_args(hosts, script, "--grace_period", "60")]
    env = job_env(slurm, tmp_path, READY_DIR=str(ready), CLEANUP_S="60")
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        pids = wait_ready(ready, 2, proc)
        (head,) = [c for c in psutil.Process(proc.pid).children() if "launcher.cli" in " ".join(c.cmdline())]
        head.send_signal(signal.SIGINT)
        time.sleep(1.0)
        t0 = time.monotonic()
        head.send_signal(signal.SIGINT)  # the workers would take 60 s to clean up
        out, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 130, out + err
    assert elapsed < 10, out + err
    assert "cleaned up" not in out
    assert alive(pids) == [] and job_processes(script) == []


def test_a_node_that_finishes_first_does_not_end_the_others(slurm: Cluster, tmp_path: Path) -> None:
    hosts = write(tmp_path, "hosts", "node2 slots=1\nnode1 slots=1\n")
    script = write(tmp_path, "uneven.py", UNEVEN_WORKER)
    res = salloc(slurm, tmp_path, ["-N2"], dslaunch_args(hosts, script))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[node2 rank 0] rank 0 finished" in res.stdout, res.stdout + res.stderr
    assert "[node1 rank 1] rank 1 finished" in res.stdout


def test_scancel_leaves_nothing_running(slurm: Cluster, tmp_path: Path) -> None:
    hosts = write(tmp_path, "hosts", "node2 slots=1\nnode1 slots=1\n")
    script = write(tmp_path, "worker.py", SLEEP_WORKER)
    ready = tmp_path / "ready"
    ready.mkdir()
    res = sbatch(slurm, tmp_path, ["-N2"], dslaunch_args(hosts, script, "--grace_period", "2"),
                 READY_DIR=str(ready))  # fmt: skip
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    pids = wait_ready(ready, 2)
    assert len(alive(pids)) == 4  # 2 workers, 2 children
    t0 = time.monotonic()
    slurm.run("scancel", job)
    job_out = tmp_path / "job.out"
    # Everything of the job (head, guard, srun, agents, workers, their children) is gone within seconds.
    while job in slurm.jobs() or alive(pids) or job_processes(script):
        assert time.monotonic() - t0 < 30, (alive(pids), job_processes(script), job_out.read_text())
        time.sleep(0.1)
    assert "dslaunch: interrupted: all workers stopped" in job_out.read_text()


def test_single_node_job_without_hostfile_in_a_batch_script(slurm: Cluster, tmp_path: Path) -> None:
    script = write(tmp_path, "env.py", ENV_WORKER)
    argv = [*DSLAUNCH, "--num_gpus", "2", "--master_port", str(free_port()), str(script)]
    res = sbatch(slurm, tmp_path, ["-N1", "-w", "node2"], argv)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 60
    while job in slurm.jobs():  # sbatch --wait polls every few seconds; this is faster
        assert time.monotonic() < deadline, "the batch job did not end"
        time.sleep(0.1)
    out = (tmp_path / "job.out").read_text()
    assert "ExitCode=0:0" in slurm.run("scontrol", "show", "job", "-o", job).stdout, out
    assert sorted(re.findall(r"NODE (\S+) (\d) (\d)", out)) == [("node2", "0", "2"), ("node2", "1", "2")], out


def test_gpus_allocated_per_task_all_reach_the_node_agent(slurm: Cluster, tmp_path: Path) -> None:
    if not slurm.gpus:
        pytest.skip("the Slurm testbed has no fake GPUs here (mknod not allowed)")
    hosts = write(tmp_path, "hosts", f"node2 slots={slurm.gpus}\nnode1 slots={slurm.gpus}\n")
    script = write(tmp_path, "env.py", ENV_WORKER)
    alloc = ["-N2", f"--ntasks-per-node={slurm.gpus}", "--gpus-per-task=1"]  # the srun-per-GPU style
    res = salloc(slurm, tmp_path, alloc, dslaunch_args(hosts, script))
    assert res.returncode == 0, res.stdout + res.stderr
    every_gpu = ",".join(str(i) for i in range(slurm.gpus))
    seen = re.findall(r"NODE (\S+) (\d) \d step-gpus=(\S+)", res.stdout)
    assert len(seen) == 2 * slurm.gpus, res.stdout + res.stderr
    assert {gpus for _, _, gpus in seen} == {every_gpu}, res.stdout  # not one GPU per node


def test_gpus_per_task_need_the_same_number_of_workers_on_every_node() -> None:
    job = JobConfig(script="train.py", python=sys.executable, job_id="j", cwd="/w")
    even = make_plan([HostSlots("a", (0, 1)), HostSlots("b", (0, 1))], job)
    uneven = make_plan([HostSlots("a", (0, 1)), HostSlots("b", (0,))], job)
    assert gpu_request(even, {}) == []  # GPUs per node or per job: the step gets them all anyway
    assert gpu_request(even, {"SLURM_GPUS_PER_TASK": "1"}) == ["--gpus-per-node=2"]
    with pytest.raises(LaunchError, match=r"different numbers of workers; allocate with --gpus-per-node"):
        gpu_request(uneven, {"SLURM_GPUS_PER_TASK": "1"})


def test_a_host_outside_the_allocation_is_refused_before_anything_starts(
    slurm: Cluster, tmp_path: Path
) -> None:
    hosts = write(tmp_path, "hosts", "node1 slots=1\nnode2 slots=1\n")
    script = write(tmp_path, "env.py", ENV_WORKER)
    res = salloc(slurm, tmp_path, ["-N1", "-w", "node1"], dslaunch_args(hosts, script))
    assert res.returncode == 2, res.stdout + res.stderr
    assert re.search(r"node2 is not a node of this allocation \(job \d+: node1\)", res.stderr), res.stderr
    assert "NODE" not in res.stdout
