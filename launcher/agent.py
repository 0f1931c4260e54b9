"""The node agent: starts one node's workers, streams their output, and never leaves one behind.

Run as ``python -m launcher.agent``. It imports only light stdlib modules and three stdlib-only parts
of the ``launcher`` package (``launcher.agentspec``, its input; ``launcher.stop``, the stop sequence;
``launcher.errorfile``, the worker error file), because it is started once per node, locally and over
SSH/pdsh/mpirun/srun, and its start-up time is part of every launch.

Input: a spec (JSON), described in ``launcher.agentspec`` (how it arrives, how a node is picked).

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
    (code 127 for a missing program, 126 otherwise). When a worker that exited non-zero left an error
    file (``launcher.errorfile``), the event also carries its ``message``, ``hint``, ``kind`` and
    ``traceback``.
  - ``{"ev": "stopping", "reason", "detail"}`` -- the agent is stopping every worker. ``reason`` is
    one of ``worker_failed``, ``stdin_eof``, ``parent_died``, ``stdout_closed``, ``signal``,
    ``stop_command``, ``kill_command``, ``completed`` (all workers exited 0 but some left processes).
  - ``{"ev": "error", "message"}`` -- the agent could not run (bad spec); it exits 2.
  - ``{"ev": "leftovers", "count", "commands"}`` -- before ``done``: how many processes the job left
    behind (``launcher.leftovers``) the agent ended, and the first few command lines.
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
stdin from /dev/null, and ``DSLAUNCH_ERROR_FILE``/``TORCHELASTIC_ERROR_FILE`` set to a fresh path in a
private directory that the agent removes when it ends. Stopping (``launcher.stop``) sends SIGTERM to
every worker's process group, waits ``grace_period`` seconds, then sends SIGKILL to every group that
still has members, including groups whose leader already exited (their children must not outlive the
job). The agent is the child subreaper of everything its workers start, and the same two signals reach
the job's processes outside those groups (``launcher.leftovers``). A ``stop`` command or a first signal
while already stopping changes nothing: only ``kill``, a second signal or the end of the grace period
kills. The agent exits with the first failing worker's code
(128 + signal for a signal death); if no worker failed but the agent was stopped, with 128 + the signal
number for a signal, 129 for a lost lifeline or closed stdout, 143 for a ``stop`` or ``kill`` command;
otherwise 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections import deque

from launcher.agent_worker import Worker, exit_code_of, write_all
from launcher.agentspec import PROTOCOL_VERSION, SpecError, decode_spec_arg, encode_spec_arg, load_spec
from launcher.errorfile import error_file_env, make_error_dir, read_error_file, traceback_block
from launcher.leftovers import Leftovers
from launcher.stop import StopAction, StopSequence, StopState

__all__ = ["EVENT_PREFIX", "PROTOCOL_VERSION", "Agent", "decode_spec_arg", "encode_spec_arg", "main"]

EVENT_PREFIX = b"@dslaunch "
MAX_LINE = 64 * 1024
_READ_SIZE = 64 * 1024
_DRAIN_READS = 16  # x _READ_SIZE: a full pipe at Linux's default pipe-max-size (1 MiB)
_POLL_S = 0.1  # SIGCHLD and the wake-up pipe make most reactions immediate; this bounds the rest

EXIT_BAD_SPEC = 2
EXIT_LIFELINE = 128 + signal.SIGHUP
EXIT_STOP_COMMAND = 128 + signal.SIGTERM


class Agent:
    """One node's workers and the loop that watches them. ``run`` returns the exit code."""

    def __init__(self, spec: dict, stdin_leftover: bytes = b"") -> None:
        self.spec = spec
        self.node = int(spec.get("node_rank", 0))
        self.grace = float(spec.get("grace_period", 5.0))
        self.lifeline = set(spec.get("lifeline", ["stdin", "parent"]))
        self.workers: list[Worker] = []
        self.stop = StopSequence(self.grace)
        self.failure_code: int | None = None
        self.stop_code = 0
        self.stdout_ok = True
        self.omp_threads: int | None = None
        self.error_dir: str | None = None
        self.leftovers = Leftovers()  # processes of the job outside the worker groups (launcher.leftovers)
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
            write_all(1, data)
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
        self.error_dir = make_error_dir()
        default_cwd = self.spec.get("cwd")
        for ws in specs:
            w = Worker(int(ws["rank"]), int(ws.get("local_rank", 0)))
            self.workers.append(w)
            env = dict(base)
            env.update({k: str(v) for k, v in ws.get("env", {}).items()})
            if self.omp_threads is not None and "OMP_NUM_THREADS" not in env:
                env["OMP_NUM_THREADS"] = str(self.omp_threads)
            if self.error_dir:
                w.error_path = os.path.join(self.error_dir, f"rank_{w.rank}.json")
                with contextlib.suppress(FileNotFoundError):  # fresh for every start
                    os.unlink(w.error_path)
                env.update(error_file_env(w.error_path))
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
                    "exited", rank=w.rank, code=code, signal=None, stopped=self.stop.stopping, error=str(exc)
                )
                self._note_failure(code, f"rank {w.rank} could not start")
                break
            w.pid = w.proc.pid
            w.fd = w.pipe().fileno()
            os.set_blocking(w.fd, False)  # _reap drains it without waiting for a holder to close it
            self._sel.register(w.fd, selectors.EVENT_READ, w)
            self.event("started", rank=w.rank, local_rank=w.local_rank, pid=w.pid)

    def _forward(self, w: Worker) -> bool:
        """Forward what the worker's pipe holds now (one read); False when it held nothing."""
        try:
            data = os.read(w.fd, _READ_SIZE)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self._sel.unregister(w.fd)
            w.pipe().close()
            w.fd = -1
            if w.partial:
                self._out(w.prefix + w.partial + b"\n")
                w.partial = b""
            if w.log:
                w.log.close()
                w.log = None
            return False
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
        return True

    def _reap(self) -> None:
        # Workers found exited in one pass ended before this pass's stop, if any: the first may be a
        # peer that only lost the second (the head sorts causes from consequences, launcher.summary).
        stopped = self.stop.stopping
        for w in self.workers:
            if w.exited or w.proc is None:
                continue
            rc = w.proc.poll()
            if rc is None:
                continue
            w.exited = True
            code, signame = exit_code_of(rc)
            # Its last output goes before its exit event (the head's tail of it). Bounded: what a pipe
            # can hold (1 MiB at most), as a process it left behind may keep writing to the same pipe.
            for _ in range(_DRAIN_READS):
                if w.fd < 0 or not self._forward(w):
                    break
            fields: dict[str, object] = {}
            if code != 0 and w.error_path:
                w.error = read_error_file(w.error_path)
                if w.error is not None:
                    fields = {
                        "message": w.error.message,
                        "hint": w.error.hint,
                        "kind": w.error.kind,
                        "traceback": w.error.traceback,
                    }
            self.event(
                "exited", rank=w.rank, code=code, signal=signame, stopped=stopped, error=None, **fields
            )
            if code != 0 and not stopped:
                self._note_failure(code, f"rank {w.rank} exited with {signame or code}")

    def _note_failure(self, code: int, detail: str) -> None:
        if self.failure_code is None:
            self.failure_code = code
        self._begin_stop("worker_failed", detail, code)

    # -- stopping -------------------------------------------------------------------------------
    def _signal_groups(self, sig: int) -> int:
        """Send ``sig`` to every worker's process group and to every process of the job outside the
        running workers' groups (``launcher.leftovers``); return how many groups and processes remain."""
        alive = 0
        for w in self.workers:
            if w.pid:
                try:
                    os.killpg(w.pid, sig)
                    alive += 1
                except (ProcessLookupError, PermissionError):
                    pass
        running = {w.pid for w in self.workers if w.pid and not w.exited}
        return alive + self.leftovers.signal(sig, {w.pid for w in self.workers}, running)

    def _begin_stop(self, reason: str, detail: str, code: int) -> None:
        """Every stop request goes through here; ``launcher.stop`` decides what it means."""
        first = not self.stop.stopping
        now = time.monotonic()
        if reason == "kill_command":
            action = self.stop.kill(now, reason)
        else:
            action = self.stop.stop(now, reason, interrupt=reason == "signal")
        if first:
            self.stop_code = code
            self.event("stopping", reason=reason, detail=detail)
        self._act(action)

    def _act(self, action: StopAction) -> None:
        if action is StopAction.TERMINATE:
            self._signal_groups(signal.SIGTERM)
        elif action is StopAction.KILL:
            self._signal_groups(signal.SIGKILL)

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

        self.leftovers.adopt_orphans()
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
            self.leftovers.reap({w.pid for w in self.workers if not w.exited})
            self._reap()
            now = time.monotonic()
            self._act(self.stop.tick(now))
            if all(w.exited for w in self.workers):
                # Leaders are gone; their groups must be empty too before we call the node done.
                if not self.stop.stopping and self._signal_groups(0):
                    self._begin_stop("completed", "workers left processes behind", 0)
                if self.stop.state is StopState.STOPPING and self._signal_groups(0):
                    continue
                if finish_by is None:
                    finish_by = now + 1.0
                if all(w.fd < 0 for w in self.workers) or now >= finish_by:
                    break
        self.stop.finish()
        self._end_leftovers()
        for w in self.workers:  # output held by a process outside the group: flush what we have
            if w.fd >= 0 and w.partial:
                self._out(w.prefix + w.partial + b"\n")
        self._finish_error_files()
        code = self.failure_code if self.failure_code is not None else self.stop_code
        self.event("done", code=code)
        return code

    def _end_leftovers(self) -> None:
        """Wait (briefly) for the processes ended as leftovers to be gone, then say how many there were."""
        deadline = time.monotonic() + max(1.0, self.grace)
        while True:  # reaped here, not by whatever adopts them after us (a container's init may not)
            alive = self._signal_groups(0) if self.leftovers.ended else 0
            self.leftovers.reap(set())  # after the count: one that died in between is reaped too
            if not alive or time.monotonic() > deadline:
                break
            self._signal_groups(signal.SIGKILL)  # the job is over: anything still here is past its grace
            time.sleep(0.02)
        if self.leftovers.ended:
            self.event("leftovers", count=len(self.leftovers.ended), commands=self.leftovers.commands)

    def _finish_error_files(self) -> None:
        """Append each failed worker's traceback to its agent-side log, then remove the error files."""
        log_dir = self.spec.get("log_dir")
        for w in self.workers:
            if log_dir and w.error is not None and w.error.traceback:
                log_path = os.path.join(log_dir, f"rank_{w.rank}.log")
                with contextlib.suppress(OSError), open(log_path, "ab") as f:
                    f.write(traceback_block(w.error.traceback))
            if w.error_path:
                with contextlib.suppress(OSError):
                    os.unlink(w.error_path)
        if self.error_dir:
            with contextlib.suppress(OSError):
                os.rmdir(self.error_dir)


def main(argv: list[str] | None = None) -> int:
    try:
        spec, leftover = load_spec(sys.argv[1:] if argv is None else argv)
    except SpecError as exc:
        msg = {"ev": "error", "node": 0, "message": f"dslaunch agent: {exc}"}
        write_all(1, EVENT_PREFIX + json.dumps(msg).encode() + b"\n")
        write_all(1, EVENT_PREFIX + json.dumps({"ev": "done", "node": 0, "code": 2}).encode() + b"\n")
        return EXIT_BAD_SPEC
    return Agent(spec, leftover).run()


if __name__ == "__main__":
    # os._exit: the stdin thread may sit in os.read; a normal interpreter exit could trip over it.
    os._exit(main())
