"""Multi-node launch latency: dslaunch over SSH against plain pdsh, on the same fake hosts.

Starts a testbed of real sshd servers (tests/support/sshd_testbed.py: one per host on 127.0.0.x, root only)
with the largest host count asked for, then for each count N (default 2, 4, 8) and each launcher, several
repetitions, interleaved. The clock starts just before the launcher process is created; each worker's
first action writes ``time.time()`` to a file. Measured per run:

* ``all_started_s``: until the last worker ran its first line (every worker on every host is running);
* ``exit_s``: until the launcher exited after the workers returned (start + teardown);
* ``head_cpu_s``: CPU time of the launcher and its children on the head (the fake hosts' sshd, shells and
  workers are not counted: on a real cluster they run on the hosts, here they share the head's cores);
* ``hosts_cpu_s``: CPU time spent on the fake hosts (their sshd, the login shells, agents and workers),
  read from each host's sshd once the host is idle again. Every fake host shares this machine's cores,
  so ``head_cpu_s + hosts_cpu_s`` is what a launch costs here, and it depends less on what else the
  machine runs than the times do (other load stretches those).

The launcher's bytecode is compiled first (as ``pip install`` does), so that a checkout run with
``PYTHONDONTWRITEBYTECODE=1`` does not compile its source at every launch.

Launchers: ``dslaunch`` (the SSH runner: preflight of every host, then one channel per host),
``dslaunch-pdsh`` (``--launcher pdsh``) and ``pdsh`` (pdsh starting the workers itself, with no
preflight, no agent and no cleanup: the floor a fan-out tool gives). ``--ref DIR`` adds ``dslaunch-ref``:
the SSH runner of another checkout (e.g. ``git archive HEAD~3 | tar -x -C DIR``), run from that
directory, so that a change is measured against what it replaces in the same run, under the same load.

Output: JSON lines on stdout (stamped with the commit, date, machine and command: common.py; ``--out``
appends them to a file too), one per run, then one summary per (launcher, N) with medians,
``scale_8_over_2`` (median at the largest N over the median at the smallest) and, for each launcher but
plain pdsh, ``ratio_to_pdsh``: the median over repetitions of its ``all_started_s`` over plain pdsh's in the
same repetition (the two runs are seconds apart, so a load change hits both), with ``ratio_to_pdsh_min`` /
``_max`` for the spread.

    python scripts/bench/launch_multinode.py --reps 5 --sizes 2,4,8 --slots 1
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.bench.common import add_out_argument, emit, free_port, out_file  # noqa: E402
from tests.support import sshd_testbed  # noqa: E402 - after the path set-up

WORKER = """\
import os, sys, time
t = time.time()
name = sys.argv[1] if len(sys.argv) > 1 else os.environ["RANK"]
with open(os.path.join(os.environ["BENCH_DIR"], name), "w") as f:
    f.write(repr(t))
"""


def command(launcher: str, tb: sshd_testbed.Testbed, n: int, slots: int, script: Path, out: Path):
    """(argv, extra environment) of one launch."""
    hostfile = tb.write_hostfile(out.parent / f"hostfile{n}", slots=slots, hosts=tb.names[:n])
    if launcher.startswith("dslaunch"):
        argv = [sys.executable, "-m", "launcher.cli", "--hostfile", str(hostfile), "--ssh_config",
                str(tb.ssh_config), "--master_port", str(free_port()), "--no_local_rank",
                "--env", f"BENCH_DIR={out}"]  # fmt: skip
        if launcher == "dslaunch-ref":  # the other checkout's launcher comes first on sys.path
            return [*argv, str(script)], {"PYTHONPATH": os.environ["BENCH_REF"]}
        if launcher == "dslaunch-pdsh":
            argv += ["--launcher", "pdsh"]
        return [*argv, str(script)], {}
    py, s = shlex.quote(sys.executable), shlex.quote(str(script))
    starts = " & ".join(f"{py} -u {s} %h-{i}" for i in range(slots))
    remote = f"cd {shlex.quote(str(REPO))} && export BENCH_DIR={shlex.quote(str(out))} && {starts} & wait"
    argv = ["pdsh", "-S", "-R", "ssh", "-f", str(n), "-w", ",".join(tb.names[:n]), remote]
    return argv, {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": f"-F {tb.ssh_config}"}


def one_run(launcher: str, tb, n: int, slots: int, script: Path, work: Path, rep: int) -> dict:
    out = work / f"{launcher}-{n}-{rep}"
    out.mkdir()
    argv, env = command(launcher, tb, n, slots, script, out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    hosts = tb.names[:n]
    _wait_idle(tb, hosts)
    host_cpu0 = sum(tb.cpu_seconds(h) for h in hosts)
    cpu0 = _children_cpu()
    t0 = time.time()
    cwd = env.get("PYTHONPATH", REPO)  # dslaunch-ref: remote agents import from their working directory
    r = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    t_exit = time.time()
    head_cpu = _children_cpu() - cpu0
    _wait_idle(tb, hosts)
    hosts_cpu = sum(tb.cpu_seconds(h) for h in hosts) - host_cpu0
    stamps = [float(f.read_text()) for f in out.iterdir()]
    if r.returncode != 0 or len(stamps) != n * slots:
        raise RuntimeError(f"{launcher} n={n}: rc {r.returncode}, {len(stamps)} workers\n{r.stderr[-2000:]}")
    return {"bench": "launch_multinode", "launcher": launcher, "hosts": n, "slots": slots, "rep": rep,
            "all_started_s": round(max(stamps) - t0, 4), "exit_s": round(t_exit - t0, 4),
            "head_cpu_s": round(head_cpu, 4), "hosts_cpu_s": round(hosts_cpu, 4)}  # fmt: skip


def _wait_idle(tb, hosts: list[str], timeout: float = 10.0) -> None:
    """Until no session is left on the hosts (sshd has reaped them: their CPU time is counted)."""
    deadline = time.monotonic() + timeout
    while any(tb.processes(h) for h in hosts) and time.monotonic() < deadline:
        time.sleep(0.02)


def _children_cpu() -> float:
    """CPU seconds of finished children: the launcher and what it ran on the head (not the sshd side)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2,4,8")
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--launchers", default="dslaunch,dslaunch-pdsh,pdsh")
    p.add_argument("--isolate", choices=["ns", "plain"], default="ns")
    p.add_argument("--ref", type=Path, help="another checkout to compare with (adds dslaunch-ref)")
    add_out_argument(p, "launch-multinode")
    a = p.parse_args()
    a.out = out_file(a.out, "launch-multinode")
    reason = sshd_testbed.unavailable_reason()
    if reason:
        print(f"launch_multinode: {reason}", file=sys.stderr)
        return 2
    sizes = [int(x) for x in a.sizes.split(",")]
    launchers = a.launchers.split(",")
    if a.ref:
        os.environ["BENCH_REF"] = str(a.ref.resolve())
        launchers.insert(0, "dslaunch-ref")
    # An installed dslaunch has its bytecode; a checkout run with PYTHONDONTWRITEBYTECODE=1 (set on the
    # test machines) would compile the launcher's source at every launch and measure that instead.
    for tree in [REPO, *([a.ref] if a.ref else [])]:
        compileall.compile_dir(str(Path(tree) / "launcher"), quiet=1)
    with tempfile.TemporaryDirectory(prefix="dsl-bench-") as tmp:
        work = Path(tmp)
        script = work / "worker.py"
        script.write_text(WORKER)
        tb = sshd_testbed.start(work / "testbed", max(sizes), a.slots, a.isolate)
        try:
            results: dict[tuple[str, int], list[dict]] = {}
            for rep in range(a.reps):
                for n in sizes:
                    for launcher in launchers:  # interleaved: load drifts hit every launcher alike
                        row = one_run(launcher, tb, n, a.slots, script, work, rep)
                        results.setdefault((launcher, n), []).append(row)
                        emit(row, a.out)
        finally:
            tb.stop()
    for launcher in launchers:
        med = {n: statistics.median(r["all_started_s"] for r in results[(launcher, n)]) for n in sizes}
        for n in sizes:
            rows = results[(launcher, n)]
            summary = {
                "bench": "launch_multinode", "summary": True, "launcher": launcher, "hosts": n,
                "slots": a.slots, "reps": len(rows), "all_started_s_median": round(med[n], 4),
                "exit_s_median": round(statistics.median(r["exit_s"] for r in rows), 4),
                "head_cpu_s_median": round(statistics.median(r["head_cpu_s"] for r in rows), 4),
                "hosts_cpu_s_median": round(statistics.median(r["hosts_cpu_s"] for r in rows), 4),
                "scale_8_over_2": round(med[max(sizes)] / med[min(sizes)], 3),
            }  # fmt: skip
            if launcher != "pdsh" and ("pdsh", n) in results:
                base = results[("pdsh", n)]
                ratios = [r["all_started_s"] / p["all_started_s"] for r, p in zip(rows, base, strict=True)]
                summary["ratio_to_pdsh"] = round(statistics.median(ratios), 3)
                summary["ratio_to_pdsh_min"] = round(min(ratios), 3)
                summary["ratio_to_pdsh_max"] = round(max(ratios), 3)
            emit(summary, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
