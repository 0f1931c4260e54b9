"""The node agent: starts one node's workers, streams their output, and never leaves one behind.

Run as ``python -m launcher.agent`` (or with this file's source passed to ``python -c``: it imports
nothing from the ``launcher`` package and only light stdlib modules, because it is started once per
node, locally and over SSH/pdsh/mpirun/srun, and its start-up time is part of every launch).

Input: a spec (JSON)
--------------------
The spec arrives in one of three ways:

* the first line of stdin (default; the local and SSH runners use this);
* ``--spec-b64 DATA``: ``encode_spec_arg(spec)``, i.e. urlsafe base64 of zlib-compressed JSON, for
  tools that do not carry stdin (pdsh, mpirun, srun);
* ``--spec-file PATH``: a JSON file (e.g. on a shared file system).

A spec is either a *node spec* or a *job spec* ``{"version": 1, "nodes": [node spec, ...]}`` from which
the agent picks its node with ``--node-index N`` (pdsh substitutes ``%n``), ``--node-index-env VAR``
(e.g. ``OMPI_COMM_WORLD_RANK`` or ``SLURM_NODEID`` with one agent per node) or ``--node-host NAME``.

Node spec (``version`` 1)::

    {"version": 1, "job_id": str, "node_rank": int, "host": str,
     "env": {K: V},            # set for every worker, over the agent's inherited environment
     "env_defaults": {K: V},   # set only where the resulting environment lacks K
     "omp_threads_auto": bool, # OMP_NUM_THREADS = usable CPUs // workers on this node, if unset
     "cwd": str | null,        # default working directory of the workers
     "log_dir": str | null,    # the agent writes <log_dir>/rank_<R>.log (raw worker output)
     "grace_period": float,    # seconds between SIGTERM and SIGKILL when stopping
     "lifeline": ["stdin", "parent"],   # what counts as "the launcher is gone" (see below)
     "workers": [{"rank": int, "local_rank": int, "argv": [str, ...],
                  "env": {K: V}, "cwd": str | null}, ...]}

Output: the line protocol on stdout
-----------------------------------
Every line the agent writes to stdout is one of:

* ``<rank>:<bytes>`` -- one line of a worker's output (stdout and stderr merged, in the order the
  worker wrote them), ``rank`` the worker's global rank in decimal. The bytes are passed through
  undecoded, without the newline. A line longer than 64 KiB is cut into several lines; a last line
  without a newline is still sent.
* ``@dslaunch <json>`` -- an event, one JSON object with ``"ev"`` and ``"node"`` (node rank):

  - ``{"ev": "agent", "pid", "hostname", "host", "version", "omp_num_threads"}`` -- first line;
    ``omp_num_threads`` is the value the agent set, or null when it set none.
  - ``{"ev": "started", "rank", "local_rank", "pid"}`` -- a worker runs; its process group id equals
    its pid.
  - ``{"ev": "exited", "rank", "code", "signal", "stopped", "error"}`` -- a worker ended. ``code`` is
    its exit status, or 128 + signal number when a signal killed it (``signal`` then names it, e.g.
    ``"SIGKILL"``). ``stopped`` is true when the agent was already stopping the node, so the exit is
    a consequence, not a cause. ``error`` is set when the worker could not be started at all
    (code 127 for a missing program, 126 otherwise).
  - ``{"ev": "stopping", "reason", "detail"}`` -- the agent is stopping every worker. ``reason`` is
    one of ``worker_failed``, ``stdin_eof``, ``parent_died``, ``stdout_closed``, ``signal``,
    ``stop_command``, ``kill_command``, ``completed`` (all workers exited 0 but some left processes).
  - ``{"ev": "error", "message"}`` -- the agent could not run (bad spec); it exits 2.
  - ``{"ev": "done", "code"}`` -- last line; ``code`` is the agent's exit code.

Anything else on the stream (a Python traceback of a crashed agent, transport noise) is not from the
protocol; a reader shows it as it is. The absence of ``done`` before EOF means the agent was lost.

Control: stdin after the spec
-----------------------------
Lines ``stop`` (graceful: SIGTERM, grace period, SIGKILL) and ``kill`` (SIGKILL every worker group now).
With lifeline ``stdin``, EOF on stdin means the launcher or its connection is gone: stop. With lifeline
``parent``, a change of the parent pid (the parent died and the agent was re-parented) means the same.
SIGINT/SIGTERM/SIGHUP stop gracefully; a second one kills at once.

Process handling and exit code
------------------------------
Each worker runs in its own session (``start_new_session``), so its process group id is its pid, with
stdin from /dev/null. Stopping sends SIGTERM to every worker's process group, waits ``grace_period``
seconds, then sends SIGKILL to every group that still has members, including groups whose leader already
exited (their children must not outlive the job). The agent exits with the first failing worker's code
(128 + signal for a signal death); if no worker failed but the agent was stopped, with 128 + the signal
number for a signal, 129 for a lost lifeline or closed stdout, 143 for a ``stop`` or ``kill`` command;
otherwise 0.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections import deque

PROTOCOL_VERSION = 1
EVENT_PREFIX = b"@dslaunch "
MAX_LINE = 64 * 1024
_READ_SIZE = 64 * 1024
_POLL_S = 0.1  # SIGCHLD and the wake-up pipe make most reactions immediate; this bounds the rest

EXIT_BAD_SPEC = 2
EXIT_LIFELINE = 128 + signal.SIGHUP
EXIT_STOP_COMMAND = 128 + signal.SIGTERM


def encode_spec_arg(spec: dict) -> str:
    """The ``--spec-b64`` form of a spec: urlsafe base64 of zlib-compressed compact JSON."""
    raw = json.dumps(spec, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(zlib.compress(raw, 6)).decode("ascii")


def decode_spec_arg(data: str) -> dict:
    return json.loads(zlib.decompress(base64.urlsafe_b64decode(data.encode("ascii"))))


def exit_code_of(returncode: int) -> tuple[int, str | None]:
    """Popen returncode -> (shell-style exit code, signal name or None)."""
    if returncode >= 0:
        return returncode, None
    signum = -returncode
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return 128 + signum, name


class SpecError(Exception):
    pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:  # an inherited non-blocking stdout: wait a little and retry
            time.sleep(0.001)
            continue
        view = view[n:]


class _Worker:
    __slots__ = ("exited", "fd", "local_rank", "log", "partial", "pid", "prefix", "proc", "rank")

    def __init__(self, rank: int, local_rank: int) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.prefix = b"%d:" % rank
        self.proc: subprocess.Popen | None = None
        self.pid = 0
        self.fd = -1
        self.partial = b""
        self.log = None
        self.exited = False


class Agent:
    """One node's workers and the loop that watches them. ``run`` returns the exit code."""

    def __init__(self, spec: dict, stdin_leftover: bytes = b"") -> None:
        self.spec = spec
        self.node = int(spec.get("node_rank", 0))
        self.grace = float(spec.get("grace_period", 5.0))
        self.lifeline = set(spec.get("lifeline", ["stdin", "parent"]))
        self.workers: list[_Worker] = []
        self.stopping = False
        self.killed = False
        self.kill_deadline = 0.0
        self.failure_code: int | None = None
        self.stop_code = 0
        self.stdout_ok = True
        self.omp_threads: int | None = None
        # Requests from signal handlers and the stdin thread, acted on by the main loop only. A deque,
        # not a lock: a signal handler runs in the main thread and must never wait for it.
        self._requests: deque[tuple[str, str, int]] = deque()
        self._stdin_leftover = stdin_leftover
        self._ppid = os.getppid()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # -- output ---------------------------------------------------------------------------------
    def _out(self, data: bytes) -> None:
        if not self.stdout_ok:
            return
        try:
            _write_all(1, data)
        except (BrokenPipeError, OSError):
            # Nobody reads us any more: the launcher is gone. Stop the node; keep running silently.
            self.stdout_ok = False
            self._request("stdout_closed", "stdout is closed", EXIT_LIFELINE)

    def event(self, ev: str, **fields: object) -> None:
        fields = {"ev": ev, "node": self.node, **fields}
        self._out(EVENT_PREFIX + json.dumps(fields, separators=(",", ":")).encode() + b"\n")

    # -- requests (thread/signal safe) ----------------------------------------------------------
    def _request(self, reason: str, detail: str, code: int) -> None:
        self._requests.append((reason, detail, code))
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"r")

    def _on_signal(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        self._request("signal", name, 128 + signum)

    def _stdin_loop(self) -> None:
        buf = self._stdin_leftover
        while True:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                cmd = line.strip()
                if cmd == b"stop":
                    self._request("stop_command", "stop", EXIT_STOP_COMMAND)
                elif cmd == b"kill":
                    self._request("kill_command", "kill", EXIT_STOP_COMMAND)
            try:
                chunk = os.read(0, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                if "stdin" in self.lifeline:
                    self._request("stdin_eof", "stdin reached EOF", EXIT_LIFELINE)
                return
            buf += chunk

    # -- workers --------------------------------------------------------------------------------
    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for key, value in self.spec.get("env_defaults", {}).items():
            env.setdefault(key, str(value))
        env.update({k: str(v) for k, v in self.spec.get("env", {}).items()})
        return env

    def _usable_cpus(self) -> int:
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:
            return os.cpu_count() or 1

    def start_workers(self) -> None:
        base = self._base_env()
        specs = self.spec["workers"]
        if self.spec.get("omp_threads_auto") and "OMP_NUM_THREADS" not in base and specs:
            self.omp_threads = max(1, self._usable_cpus() // len(specs))
        self.event(
            "agent",
            pid=os.getpid(),
            hostname=os.uname().nodename,
            host=self.spec.get("host"),
            version=PROTOCOL_VERSION,
            omp_num_threads=self.omp_threads,
        )
        log_dir = self.spec.get("log_dir")
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        default_cwd = self.spec.get("cwd")
        for ws in specs:
            w = _Worker(int(ws["rank"]), int(ws.get("local_rank", 0)))
            self.workers.append(w)
            env = dict(base)
            env.update({k: str(v) for k, v in ws.get("env", {}).items()})
            if self.omp_threads is not None and "OMP_NUM_THREADS" not in env:
                env["OMP_NUM_THREADS"] = str(self.omp_threads)
            if log_dir:
                w.log = open(os.path.join(log_dir, f"rank_{w.rank}.log"), "wb")  # noqa: SIM115
            try:
                w.proc = subprocess.Popen(
                    ws["argv"],
                    env=env,
                    cwd=ws.get("cwd") or default_cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                w.exited = True
                code = 127 if isinstance(exc, FileNotFoundError) else 126
                self.event(
                    "exited", rank=w.rank, code=code, signal=None, stopped=self.stopping, error=str(exc)
                )
                self._note_failure(code, f"rank {w.rank} could not start")
                break
            w.pid = w.proc.pid
            w.fd = w.proc.stdout.fileno()
            self._sel.register(w.fd, selectors.EVENT_READ, w)
            self.event("started", rank=w.rank, local_rank=w.local_rank, pid=w.pid)

    def _forward(self, w: _Worker) -> None:
        try:
            data = os.read(w.fd, _READ_SIZE)
        except OSError:
            data = b""
        if not data:
            self._sel.unregister(w.fd)
            w.proc.stdout.close()
            w.fd = -1
            if w.partial:
                self._out(w.prefix + w.partial + b"\n")
                w.partial = b""
            if w.log:
                w.log.close()
                w.log = None
            return
        if w.log:
            w.log.write(data)
            w.log.flush()
        lines = (w.partial + data).split(b"\n")
        w.partial = lines.pop()
        while len(w.partial) > MAX_LINE:
            lines.append(w.partial[:MAX_LINE])
            w.partial = w.partial[MAX_LINE:]
        if lines:
            p = w.prefix
            self._out(b"".join([p + line + b"\n" for line in lines]))

    def _reap(self) -> None:
        for w in self.workers:
            if w.exited or w.proc is None:
                continue
            rc = w.proc.poll()
            if rc is None:
                continue
            w.exited = True
            code, signame = exit_code_of(rc)
            stopped = self.stopping
            self.event("exited", rank=w.rank, code=code, signal=signame, stopped=stopped, error=None)
            if code != 0 and not stopped:
                self._note_failure(code, f"rank {w.rank} exited with {signame or code}")

    def _note_failure(self, code: int, detail: str) -> None:
        if self.failure_code is None:
            self.failure_code = code
        self._begin_stop("worker_failed", detail, code)

    # -- stopping -------------------------------------------------------------------------------
    def _signal_groups(self, sig: int) -> int:
        """Send ``sig`` to every worker's process group; return how many groups still exist."""
        alive = 0
        for w in self.workers:
            if w.pid:
                try:
                    os.killpg(w.pid, sig)
                    alive += 1
                except (ProcessLookupError, PermissionError):
                    pass
        return alive

    def _begin_stop(self, reason: str, detail: str, code: int) -> None:
        if reason == "kill_command" or (self.stopping and reason in ("signal", "stop_command")):
            # A second request escalates: no more grace.
            if not self.stopping:
                self.stopping = True
                self.stop_code = code
                self.event("stopping", reason=reason, detail=detail)
            self.kill_deadline = 0.0
            return
        if self.stopping:
            return
        self.stopping = True
        self.stop_code = code
        self.event("stopping", reason=reason, detail=detail)
        self._signal_groups(signal.SIGTERM)
        self.kill_deadline = time.monotonic() + self.grace

    def _handle_requests(self) -> None:
        while self._requests:
            self._begin_stop(*self._requests.popleft())

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> int:
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
        threading.Thread(target=self._stdin_loop, name="stdin-lifeline", daemon=True).start()

        self.start_workers()
        finish_by = None  # after every worker exited: bound the wait for leftover output
        while True:
            for key, _ in self._sel.select(_POLL_S):
                if key.data is None:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                else:
                    self._forward(key.data)
            self._handle_requests()
            if "parent" in self.lifeline and os.getppid() != self._ppid:
                self._begin_stop("parent_died", f"parent {self._ppid} is gone", EXIT_LIFELINE)
            self._reap()
            now = time.monotonic()
            if self.stopping and not self.killed and now >= self.kill_deadline:
                self._signal_groups(signal.SIGKILL)
                self.killed = True
            if all(w.exited for w in self.workers):
                # Leaders are gone; their groups must be empty too before we call the node done.
                if not self.stopping and self._signal_groups(0):
                    self._begin_stop("completed", "workers left processes behind", 0)
                if self.stopping and not self.killed and self._signal_groups(0):
                    continue
                if finish_by is None:
                    finish_by = now + 1.0
                if all(w.fd < 0 for w in self.workers) or now >= finish_by:
                    break
        for w in self.workers:  # output held by a process outside the group: flush what we have
            if w.fd >= 0 and w.partial:
                self._out(w.prefix + w.partial + b"\n")
        code = self.failure_code if self.failure_code is not None else self.stop_code
        self.event("done", code=code)
        return code


def _read_stdin_line() -> tuple[bytes, bytes]:
    buf = b""
    while b"\n" not in buf:
        chunk = os.read(0, 65536)
        if not chunk:
            if buf.strip():
                return buf, b""
            raise SpecError("no spec on stdin (expected one JSON line)")
        buf += chunk
    line, rest = buf.split(b"\n", 1)
    return line, rest


def _select_node(spec: dict, args: dict[str, str]) -> dict:
    if "nodes" not in spec:
        return spec
    nodes = spec["nodes"]
    if "--node-host" in args:
        for node in nodes:
            if node.get("host") == args["--node-host"]:
                return node
        raise SpecError(f"no node with host {args['--node-host']!r} in the job spec")
    if "--node-index-env" in args:
        var = args["--node-index-env"]
        if var not in os.environ:
            raise SpecError(f"--node-index-env {var}: the variable is not set")
        index_text = os.environ[var]
    elif "--node-index" in args:
        index_text = args["--node-index"]
    else:
        raise SpecError("a job spec needs --node-index, --node-index-env or --node-host")
    try:
        index = int(index_text)
    except ValueError:
        raise SpecError(f"node index {index_text!r} is not an integer") from None
    if not 0 <= index < len(nodes):
        raise SpecError(f"node index {index} is outside 0..{len(nodes) - 1}")
    return nodes[index]


def _check_spec(spec: object) -> dict:
    if not isinstance(spec, dict):
        raise SpecError("the spec is not a JSON object")
    if spec.get("version") != PROTOCOL_VERSION:
        raise SpecError(f"spec version {spec.get('version')!r}, this agent speaks {PROTOCOL_VERSION}")
    workers = spec.get("workers")
    if not isinstance(workers, list):
        raise SpecError("the spec has no 'workers' list")
    for w in workers:
        if not isinstance(w, dict) or not isinstance(w.get("argv"), list) or not w["argv"]:
            raise SpecError(f"bad worker entry {w!r}: needs a non-empty 'argv' list")
        if not isinstance(w.get("rank"), int):
            raise SpecError(f"bad worker entry {w!r}: needs an integer 'rank'")
    return spec


_OPTIONS = ("--spec-b64", "--spec-file", "--node-index", "--node-index-env", "--node-host")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args: dict[str, str] = {}
    leftover = b""
    node = 0
    try:
        i = 0
        while i < len(argv):
            opt, eq, value = argv[i].partition("=")
            if opt not in _OPTIONS:
                raise SpecError(f"unknown argument {argv[i]!r}")
            if not eq:
                i += 1
                if i == len(argv):
                    raise SpecError(f"{opt} needs a value")
                value = argv[i]
            args[opt] = value
            i += 1
        if "--spec-b64" in args:
            raw = decode_spec_arg(args["--spec-b64"])
        elif "--spec-file" in args:
            with open(args["--spec-file"], "rb") as f:
                raw = json.loads(f.read())
        else:
            line, leftover = _read_stdin_line()
            raw = json.loads(line)
        spec = _check_spec(_select_node(raw, args))
        node = int(spec.get("node_rank", 0))
    except (SpecError, ValueError, OSError, zlib.error) as exc:
        msg = {"ev": "error", "node": node, "message": f"dslaunch agent: {exc}"}
        _write_all(1, EVENT_PREFIX + json.dumps(msg).encode() + b"\n")
        _write_all(1, EVENT_PREFIX + json.dumps({"ev": "done", "node": node, "code": 2}).encode() + b"\n")
        return EXIT_BAD_SPEC
    return Agent(spec, leftover).run()


if __name__ == "__main__":
    # os._exit: the stdin thread may sit in os.read; a normal interpreter exit could trip over it.
    os._exit(main())
