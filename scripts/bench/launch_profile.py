"""Where a multi-node SSH launch spends its time: a per-phase timeline of ``dslaunch`` on fake hosts.

``launch_multinode.py`` says how long a launch takes; this says why. It starts the same sshd testbed,
then runs the launcher (``python -m launcher.cli`` with the SSH runner) under a tracer that wraps the
functions each phase goes through and stamps when they start and end, per host:

* ``imports``: interpreter start to ``launcher.cli`` imported, then the runner module (paramiko);
* ``ssh_config`` / ``known_hosts`` / ``key_load``: how often each file is parsed, and the time it takes;
* per host: ``tcp`` (socket connect), ``kex`` (banner + key exchange + host key check), ``auth``
  (public key), ``probe`` (session open to the probe's line: remote shell, interpreter start, importing
  the agent), ``spec`` (spec sent), ``started`` (the agent's first ``started`` event reaches the head);
* ``worker``: the worker's first line (its own clock), the end of the launch as the user sees it.

The clock starts just before the launcher process is created, as in ``launch_multinode.py``. Output
(stamped with the commit, date, machine and command: common.py; ``--out`` appends it to a file too): one
JSON line per run with every phase's start and end (seconds), then a summary line with the medians of the
per-phase durations and of the slowest host's phase ends.

    python scripts/bench/launch_profile.py --hosts 8 --reps 5 [--ref DIR]

``--ref DIR`` profiles another checkout too (``git archive REV launcher | tar -x -C DIR``), alternating
with this one run by run, for a before/after breakdown under the same load.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.bench.common import add_out_argument, emit, free_port, out_file  # noqa: E402 - after the path set-up
from scripts.bench.launch_multinode import WORKER  # noqa: E402
from tests.support import sshd_testbed  # noqa: E402

# The tracer runs inside the launcher process: it patches the phase functions, then runs the CLI.
TRACER = r"""
import functools, json, os, sys, threading, time
T0 = float(os.environ["PROFILE_T0"])
EVENTS = []
_host = threading.local()

def mark(name, start, end=None, host=None):
    EVENTS.append([name, host if host is not None else getattr(_host, "name", None),
                   round(start - T0, 4), round((end if end is not None else start) - T0, 4)])

def wrap(owner, attr, name, host_from=None):
    fn = getattr(owner, attr)
    @functools.wraps(fn)
    def inner(*a, **k):
        if host_from is not None:
            _host.name = host_from(a, k)
        s = time.time()
        try:
            return fn(*a, **k)
        finally:
            mark(name, s, time.time())
    setattr(owner, attr, inner)

mark("interpreter", T0, time.time())
s = time.time(); import launcher.cli as cli; mark("import_cli", s, time.time())
s = time.time(); import launcher.runners.ssh as rs; mark("import_runner", s, time.time())
import paramiko, socket
from launcher import preflight, ssh

wrap(ssh, "load_ssh_config", "ssh_config")
wrap(paramiko.SSHClient, "load_host_keys", "known_hosts")
wrap(paramiko.SSHClient, "load_system_host_keys", "known_hosts")
for cls in (paramiko.Ed25519Key, paramiko.RSAKey, paramiko.ECDSAKey):
    if "__init__" in vars(cls):  # a subclass without its own would wrap the base's
        wrap(cls, "__init__", "key_load")
wrap(ssh, "connect", "connect", host_from=lambda a, k: getattr(a[0], "alias", a[0]))
wrap(paramiko.Transport, "start_client", "kex")
wrap(paramiko.SSHClient, "_auth", "auth")
wrap(preflight, "start_checked", "probe", host_from=lambda a, k: a[0].target.alias)
_sc = socket.socket.connect
def connect(self, addr):
    s = time.time()
    try:
        return _sc(self, addr)
    finally:
        mark("tcp", s, time.time())
socket.socket.connect = connect

_launch = rs.SSHRunner.launch
def launch(self, plan, specs):
    s = time.time()
    try:
        return _launch(self, plan, specs)
    finally:
        mark("spec_sent_all", s, time.time())
rs.SSHRunner.launch = launch

_readline = rs.SSHAgentHandle.readline
def readline(self):
    line = _readline(self)
    if b'"ev":"started"' in line.replace(b" ", b"") and not getattr(self, "_seen", False):
        self._seen = True
        mark("started", time.time(), host=self.name)
    return line
rs.SSHAgentHandle.readline = readline

import atexit
atexit.register(lambda: open(os.environ["PROFILE_OUT"], "w").write(json.dumps(EVENTS)))
sys.argv = ["dslaunch", *sys.argv[1:]]
cli.main()
"""

PER_HOST = ("tcp", "kex", "auth", "connect", "probe", "started")


def one_run(tb, n: int, script: Path, work: Path, rep: int, tree: Path = REPO) -> dict:
    out = work / f"run-{n}-{rep}-{tree.name}"
    out.mkdir()
    hostfile = tb.write_hostfile(work / f"hostfile{n}", slots=1, hosts=tb.names[:n])
    trace = work / f"trace-{n}-{rep}-{tree.name}.json"
    argv = [sys.executable, "-c", TRACER, "--hostfile", str(hostfile), "--ssh_config", str(tb.ssh_config),
            "--master_port", str(free_port()), "--no_local_rank", "--env", f"BENCH_DIR={out}",
            str(script)]  # fmt: skip
    t0 = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PROFILE_T0": repr(t0), "PROFILE_OUT": str(trace)}
    if tree != REPO:  # the other checkout's launcher first on the path, here and (cwd) on the hosts
        env["PYTHONPATH"] = str(tree)
    r = subprocess.run(argv, env=env, cwd=tree, capture_output=True, text=True, timeout=120)
    stamps = [float(f.read_text()) - t0 for f in out.iterdir()]
    if r.returncode != 0 or len(stamps) != n:
        raise RuntimeError(f"n={n}: rc {r.returncode}, {len(stamps)} workers\n{r.stderr[-2000:]}")
    events = json.loads(trace.read_text())
    row: dict = {"bench": "launch_profile", "tree": "this" if tree == REPO else "ref", "hosts": n, "rep": rep,
                 "worker_last_s": round(max(stamps), 4)}  # fmt: skip
    for name, host, start, end in events:
        if host is None or name not in PER_HOST:
            key = name
            row.setdefault(f"{key}_count", 0)
            row[f"{key}_count"] += 1
            row[f"{key}_s"] = round(row.get(f"{key}_s", 0.0) + end - start, 4)
            row[f"{key}_end"] = max(row.get(f"{key}_end", 0.0), end)
        else:
            row.setdefault("per_host", {}).setdefault(host, {})[name] = [start, end]
    hosts = row.get("per_host", {})
    for phase in PER_HOST:
        spans = [h[phase] for h in hosts.values() if phase in h]
        if spans:
            row[f"{phase}_median_s"] = round(statistics.median(e - s for s, e in spans), 4)
            row[f"{phase}_last_end"] = round(max(e for _, e in spans), 4)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--per-host", action="store_true", help="print each host's phases too")
    p.add_argument("--ref", type=Path, help="another checkout to profile too, alternating with this one")
    add_out_argument(p, "launch-profile")
    a = p.parse_args()
    a.out = out_file(a.out, "launch-profile")
    reason = sshd_testbed.unavailable_reason()
    if reason:
        print(f"launch_profile: {reason}", file=sys.stderr)
        return 2
    trees = [REPO, *([a.ref.resolve()] if a.ref else [])]
    for tree in trees:  # as launch_multinode.py does
        compileall.compile_dir(str(tree / "launcher"), quiet=1)
    with tempfile.TemporaryDirectory(prefix="dsl-profile-") as tmp:
        work = Path(tmp)
        script = work / "worker.py"
        script.write_text(WORKER)
        tb = sshd_testbed.start(work / "testbed", a.hosts, 1)
        rows: list[dict] = []
        try:
            for rep in range(a.reps):
                for tree in trees:
                    row = one_run(tb, a.hosts, script, work, rep, tree)
                    rows.append(row)
                    if not a.per_host:
                        row = {k: v for k, v in row.items() if k != "per_host"}
                    emit(row, a.out)
        finally:
            tb.stop()
    for name in dict.fromkeys(r["tree"] for r in rows):
        mine = [r for r in rows if r["tree"] == name]
        keys = sorted({k for r in mine for k, v in r.items() if isinstance(v, (int, float)) and k != "rep"})
        summary = {k: round(statistics.median(r.get(k, 0) for r in mine), 4) for k in keys}
        emit({"bench": "launch_profile", "summary": True, "tree": name, "reps": len(mine), **summary}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
