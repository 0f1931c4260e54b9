"""A real Slurm cluster on this one machine, for the ``--launcher slurm`` tests: munged, slurmctld and one
slurmd per fake node, all started by the test session in a private directory and stopped at its end.

Node i (1-based) is named ``node{i}`` and is its own slurmd (``slurmd -N node{i}``) with its own port and
spool directory; every node has this machine's CPUs (``slurmd -C``), so the nodes share the same cores.
Each node also has ``GPUS`` fake GPUs (``Gres=gpu``: character devices in the directory that are
/dev/null underneath) where mknod is allowed, so Slurm's GPU bookkeeping (which GPUs a step gets, in
``SLURM_STEP_GPUS``) is real while nothing uses a GPU. Two nodes let a test place tasks in an order
that differs from Slurm's own, which is what the Slurm runner's ``--distribution=arbitrary`` exists for.
The names do not resolve: jobs pass ``--master_addr 127.0.0.1``. Everything listens on 127.0.0.1 only
(``CommunicationParameters=NoInAddrAny,NoCtldInAddrAny`` also binds srun's own ports there); munge
uses a fresh key and a socket in the directory.

The directory holds ``slurm.conf``, ``munge/`` (key, socket, log), ``state/``, ``spool/<node>/``,
``log/`` (slurmctld.log, slurmd-<node>.log) and ``cluster.json`` (pids, for ``stop`` from the shell).
Clients find the cluster through ``SLURM_CONF`` (``Cluster.env``). The daemons carry the same
``SLURM_CONF`` in their environment, so everything a job starts (slurmstepd, the agents, the workers)
can be found and, at the end, killed: ``Cluster.processes()``.

What this machine needed, and why (verified on the 2-core container the suite runs in):

* ``ProctrackType=proctrack/linuxproc``: no cgroup set-up (it tracks a step's processes by parentage,
  like cgroups would for our agents and workers, which never leave their parent).
* ``TaskPlugin=task/affinity``: works here (sched_setaffinity), and makes the steps' CPU binding real.
* ``SlurmUser=root``/``SlurmdUser=root``, no accounting, ``ReturnToService=2``, ``MpiDefault=none``.
* ``KillOnBadExit=1`` and ``WaitTime=2``, as some sites have them: the runner must override both.
* munged ``--force``: munge wants every directory above its socket open to all users; pytest's temporary
  directories are not (0700). Every client here is root, so the check guards nothing.

Shell use (manual poking, benchmarks)::

    python tests/support/slurm_testbed.py start DIR [--nodes N]   # prints: export SLURM_CONF=DIR/slurm.conf
    python tests/support/slurm_testbed.py stop DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "salloc", "sbatch", "scancel", "squeue", "sinfo", "scontrol")
STATE_FILE = "cluster.json"
GPUS = 2  # fake GPUs per node


class SlurmUnavailable(RuntimeError):
    """The cluster could not be started here; the message says why, with the daemons' log lines."""


def unavailable_reason() -> str | None:
    """Why no cluster can be started on this machine (before trying), or None."""
    if os.geteuid() != 0:
        return "the Slurm testbed needs root (slurmd runs jobs as root here)"
    missing = [t for t in (*DAEMONS, *CLIENTS) if shutil.which(t) is None]
    if missing:
        return (
            f"{', '.join(missing)} not found: run scripts/install_system_deps.sh (installs slurm and munge)"
        )
    return None


def versions() -> str:
    """``slurm-wlm 22.05.8, munge-0.5.15`` (what the daemons report)."""
    out = []
    for argv in (["slurmd", "-V"], ["munged", "--version"]):
        res = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        out.append((res.stdout or res.stderr).split("(")[0].strip())
    return ", ".join(out)


@dataclass
class Cluster:
    """A running one-machine cluster: its files, node names and daemon pids."""

    dir: Path
    nodes: tuple[str, ...]
    cpus: int
    gpus: int = 0  # fake GPUs per node (0 where mknod is not allowed)
    pids: dict[str, int] = field(default_factory=dict)  # daemon name -> pid
    start_seconds: float = 0.0
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """This process's environment with ``SLURM_CONF`` pointing at the cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command (``squeue``, ``scancel``...) against this cluster."""
        res = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {res.returncode}: {res.stderr.strip()}")
        return res

    def jobs(self) -> list[str]:
        """Ids of the jobs the controller still knows as pending or running."""
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def wait_no_jobs(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.jobs():
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs still queued after {timeout:.0f} s: {self.jobs()}")
            time.sleep(0.1)

    def processes(self) -> list[psutil.Process]:
        """Live processes (zombies excluded) of this cluster's jobs: slurmstepd and everything started
        for a job (they carry SLURM_JOB_ID). Never the daemons, this process or its ancestors (a shell
        that exported SLURM_CONF to run ``stop``)."""
        me = psutil.Process()
        spared = {me.pid, *(p.pid for p in me.parents()), *self.pids.values()}
        found = []
        for p in psutil.process_iter(["pid", "name", "status"]):
            if p.pid in spared or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            with contextlib.suppress(psutil.Error):
                env = p.environ()
                ours = env.get("SLURM_CONF") == str(self.conf)
                if ours and ("SLURM_JOB_ID" in env or p.info["name"] == "slurmstepd"):
                    found.append(p)
        return found

    def log_tail(self, lines: int = 15) -> str:
        parts = []
        for path in [*sorted((self.dir / "log").glob("*.log")), self.dir / "munge" / "munged.log"]:
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def save(self) -> None:
        state = {"nodes": list(self.nodes), "cpus": self.cpus, "gpus": self.gpus, "pids": self.pids}
        (self.dir / STATE_FILE).write_text(json.dumps(state))

    @classmethod
    def load(cls, directory: Path) -> Cluster:
        state = json.loads((directory / STATE_FILE).read_text())
        return cls(directory, tuple(state["nodes"]), state["cpus"], state["gpus"], state["pids"])

    def stop(self) -> None:
        """Cancel every job, stop the daemons, kill whatever the jobs left behind."""
        with contextlib.suppress(Exception):
            if self.jobs():
                self.run("scancel", "--full", *self.jobs(), check=False)
                self.wait_no_jobs(timeout=15.0)
        for name in sorted(self.pids, key=lambda n: n.startswith("munged")):  # munge goes last
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pids[name], signal.SIGTERM)
        for pid in self.pids.values():
            _wait_gone(pid, 10.0)
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                p.kill()
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


def start(directory: Path, n_nodes: int = 2, timeout: float = 30.0) -> Cluster:
    """Start munged, slurmctld and ``n_nodes`` slurmd in ``directory``; return when every node is idle.

    Raises ``SlurmUnavailable`` with the daemons' last log lines when the cluster does not come up.
    """
    t0 = time.monotonic()
    cpus, memory = _this_machine()
    cluster = Cluster(directory, tuple(f"node{i + 1}" for i in range(n_nodes)), cpus)
    for sub in ("munge", "state", "log", *(f"spool/{n}" for n in cluster.nodes)):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    munge = directory / "munge"
    munge.chmod(0o700)
    key = munge / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o600)
    cluster.gpus = _fake_gpus(directory / "dev", GPUS)
    if cluster.gpus:
        (directory / "gres.conf").write_text(f"Name=gpu File={directory / 'dev'}/gpu[0-{cluster.gpus - 1}]\n")
    cluster.conf.write_text(_slurm_conf(cluster, memory))
    env = cluster.env  # the daemons carry SLURM_CONF too: it marks every process of every job

    def daemon(name: str, argv: list[str]) -> None:
        log = open(directory / "log" / f"{name}.out", "wb")  # noqa: SIM115 - the daemon holds it
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True)  # fmt: skip
        cluster._procs.append(proc)
        cluster.pids[name] = proc.pid

    try:
        daemon("munged", ["munged", "-F", "--force", f"--key-file={key}", f"--socket={munge / 'socket'}",
                          f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                          f"--seed-file={munge / 'seed'}"])  # fmt: skip
        _wait_for(lambda: (munge / "socket").exists(), 10.0, cluster, "munged did not create its socket")
        daemon("slurmctld", ["slurmctld", "-D", "-f", str(cluster.conf)])
        for node in cluster.nodes:
            daemon(f"slurmd-{node}", ["slurmd", "-D", "-f", str(cluster.conf), "-N", node])
        cluster.save()
        _wait_for(lambda: _all_idle(cluster), timeout, cluster, "the nodes did not become idle")
    except BaseException:
        cluster.stop()
        raise
    cluster.start_seconds = time.monotonic() - t0
    return cluster


def _slurm_conf(c: Cluster, memory_mb: int) -> str:
    d = c.dir
    host = socket.gethostname().split(".")[0]  # slurmctld compares it with its own short name
    nodes = "\n".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} "
        f"CPUs={c.cpus} RealMemory={memory_mb} {f'Gres=gpu:{c.gpus} ' if c.gpus else ''}State=UNKNOWN"
        for n in c.nodes
    )
    return f"""\
# A one-machine cluster for dslaunch's tests (tests/support/slurm_testbed.py); every path is private.
ClusterName=dslaunch-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d / "munge" / "socket"}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d / "state"}
SlurmdSpoolDir={d / "spool"}/%n
SlurmctldPidFile={d / "slurmctld.pid"}
SlurmdPidFile={d / "spool"}/%n/slurmd.pid
SlurmctldLogFile={d / "log" / "slurmctld.log"}
SlurmdLogFile={d / "log"}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
{"GresTypes=gpu" if c.gpus else ""}
ReturnToService=2
KillWait=10
# Settings some sites use, which a launcher must override for its step (see launcher/runners/slurm.py):
# kill every task when one exits non-zero; kill the rest 2 s after the first task ends.
KillOnBadExit=1
WaitTime=2
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _this_machine() -> tuple[int, int]:
    """(CPUs, MiB of memory to declare per node) from ``slurmd -C``; a node declaring more memory than
    slurmd finds is drained, and the jobs here need little."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    return int(fields.get("CPUs", os.cpu_count() or 1)), min(2048, int(fields.get("RealMemory", 2048)))


def _fake_gpus(directory: Path, n: int) -> int:
    """``n`` character devices named gpu0.. (slurmd accepts only devices for a GPU), or 0 if not allowed."""
    directory.mkdir(exist_ok=True)
    try:
        for i in range(n):
            os.mknod(directory / f"gpu{i}", stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's numbers
    except OSError:
        return 0
    return n


def _all_idle(c: Cluster) -> bool:
    res = c.run("sinfo", "-h", "-N", "-o", "%N %T", timeout=10, check=False)
    states = dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)
    return res.returncode == 0 and all(states.get(n) == "idle" for n in c.nodes)


def _wait_for(ready: Callable[[], bool], timeout: float, c: Cluster, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [n for n, p in zip(c.pids, c._procs, strict=False) if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = f"{', '.join(dead)} exited" if dead else f"after {timeout:.0f} s"
            raise SlurmUnavailable(f"{what} ({why}); the daemons' logs:\n{c.log_tail()}")
        time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="A one-machine Slurm cluster (see the module docstring).")
    ap.add_argument("action", choices=["start", "stop"])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--nodes", type=int, default=2)
    args = ap.parse_args(argv)
    if args.action == "start":
        reason = unavailable_reason()
        if reason:
            print(reason, file=sys.stderr)
            return 1
        c = start(args.dir.resolve(), args.nodes)
        print(f"# {versions()}; {len(c.nodes)} nodes up in {c.start_seconds:.1f} s")
        print(f"export SLURM_CONF={c.conf}")
    else:
        Cluster.load(args.dir.resolve()).stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
