"""The head: starts every node's agent, shows the workers' output, and ends the job as one.

``run_job`` runs attempts until one succeeds, the job is interrupted, or ``max_restarts`` is used up.
One attempt: build the plan for the attempt number, start one agent per node through the runner, read
every agent stream in its own thread (``runners.base`` describes the contract), and in the main thread:

* print each worker line as ``[label] text`` (the label comes from the plan: ``rank N`` on one
  machine, ``host rank N`` across machines), keep the last lines of every rank, and write
  ``<log_dir>/rank_<R>.log`` when asked (the head writes the logs, so remote ranks are logged on the
  head too; restarts write ``rank_<R>.restart_<K>.log``);
* on the first failure anywhere -- a worker exiting non-zero or killed by a signal, an agent that
  cannot run, an agent stream that ends without ``done`` -- stop every node (SIGTERM, grace period,
  SIGKILL, done by each agent) and remember that failure as the root cause;
* on SIGINT/SIGTERM stop every node; a second one kills every node at once.

The head's own side of stopping (``stop`` to every agent, ``kill`` when they overrun their grace period
by ``_STOP_SLACK_S`` or on a second signal) is a ``launcher.stop.StopSequence``, the one the agents use.

The exit code is the root-cause worker's code (128 + signal number for a signal death), 130 after
SIGINT, 143 after SIGTERM, 0 on success. After a failure a short summary (``launcher.summary``) names
the rank, host, exit code or signal and shows the rank's last output lines; ranks that failed the same
way (same exit code and error-file message) are folded into one line, and ranks that only lost their peer
are consequences of the root cause, whichever reached the head first (``launcher.summary``). A failed
worker's traceback from its error file is appended to its log file. Processes the job left behind (outside
its workers' process groups), which each agent ended, are counted in one line at the end of the attempt.
"""

from __future__ import annotations

import contextlib
import enum
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from launcher.plan import JobPlan
from launcher.runners.base import (
    AgentEvent,
    AgentHandle,
    ForeignLine,
    OutputLine,
    Runner,
    agent_spec,
    parse_agent_line,
)
from launcher.stop import StopAction, StopSequence, StopState
from launcher.summary import (
    Failure,
    arrange_failures,
    leftovers_line,
    rank_ranges,
    status_text,
    summary_lines,
)

# How long past the grace period an agent may take to report back before it is killed, and after the
# kill, before the head gives up on it (a transport that hangs must not hang the launcher).
_STOP_SLACK_S = 5.0
_KILL_SLACK_S = 5.0


class Outcome(enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class SuperviseOptions:
    grace_period: float = 5.0
    log_dir: str | None = None
    max_restarts: int = 0
    tail_lines: int = 15
    # Ranks that exited 0 while others still run this long get one note naming both: a rank waiting in
    # a collective for a finished one waits for the collective's timeout (NCCL's: 10-30 minutes) silently.
    finished_note_s: float = 60.0


@dataclass(frozen=True)
class AttemptResult:
    outcome: Outcome
    code: int
    failure: Failure | None = None  # the root cause
    failures: tuple[Failure, ...] = ()  # the root cause first, then every other worker that failed by itself
    finished: tuple[int, ...] = ()  # ranks that had exited with code 0 before the first failure


class _Attempt:
    """The state of one attempt; every method runs in the main thread."""

    def __init__(
        self,
        plan: JobPlan,
        runner: Runner,
        options: SuperviseOptions,
        say: Callable[[str], None],
        notes: set[str],
    ):
        self.plan = plan
        self.runner = runner
        self.options = options
        self.say = say
        self.out = _Console(sys.stdout.buffer, say)
        self.workers = {w.rank: w for w in plan.workers}
        self.prefix = {r: f"[{w.label}] ".encode() for r, w in self.workers.items()}
        self.tails: dict[int, deque[bytes]] = {r: deque(maxlen=options.tail_lines) for r in self.workers}
        self.node_tails: dict[int, deque[bytes]] = {n.node_rank: deque(maxlen=5) for n in plan.nodes}
        self.logs: dict[int, IO[bytes]] = {}
        self.done_nodes: set[int] = set()
        self.failure: Failure | None = None  # the first failure: it stopped the job
        self.others: list[Failure] = []  # failures after it that carry their own error or lost a peer
        self.finished: list[int] = []  # ranks that exited 0 while the job ran: the cause if a peer lost them
        self.finished_at: float | None = None  # when the first of them did
        self.exited: set[int] = set()
        self.leftovers: dict[int, tuple[str, int, list[str]]] = {}  # node -> (host, ended, commands)
        self.interrupt_code: int | None = None
        # Agents get their grace period and then some to report back before the head kills them.
        self.stop = StopSequence(options.grace_period + _STOP_SLACK_S)
        self.notes = notes  # things said once per job, across attempts
        self.handles: list[AgentHandle] = []

    # -- actions --------------------------------------------------------------------------------
    def _act(self, action: StopAction) -> None:
        for h in self.handles:
            if action is StopAction.TERMINATE:
                h.stop()
            elif action is StopAction.KILL:
                h.kill()

    def fail(self, failure: Failure) -> None:
        if self.failure is None and self.interrupt_code is None:
            self.failure = failure
        self._act(self.stop.stop(time.monotonic(), "failure"))

    def on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.interrupt_code is None:
            self.interrupt_code = 128 + signum
            self.say(f"{name}: stopping all workers ({name} again to kill them now)")
        action = self.stop.stop(time.monotonic(), name, interrupt=True)
        if action is StopAction.KILL:
            self.say("killing all workers")
        self._act(action)

    # -- messages -------------------------------------------------------------------------------
    def on_output(self, msg: OutputLine) -> None:
        prefix = self.prefix.get(msg.rank)
        if prefix is None:
            prefix = f"[rank {msg.rank}?] ".encode()
        else:
            self.tails[msg.rank].append(msg.text)
            log = self.logs.get(msg.rank)
            if log is not None:
                log.write(msg.text + b"\n")
        self.out.write(prefix + msg.text + b"\n")

    def on_event(self, handle: AgentHandle, ev: AgentEvent) -> None:
        data = ev.data
        host = self.plan.nodes[ev.node].host if 0 <= ev.node < len(self.plan.nodes) else handle.name
        if ev.kind == "agent":
            n = data.get("omp_num_threads")
            if n and "omp" not in self.notes:
                self.notes.add("omp")
                self.say(
                    f"OMP_NUM_THREADS is not set: each worker gets {n} "
                    "(usable CPUs // workers per node); set OMP_NUM_THREADS to choose"
                )
        elif ev.kind == "exited":
            code = int(data.get("code", 1))
            self.exited.add(int(data["rank"]))
            if code == 0 and self.failure is None and not self.stop.stopping:
                self.finished.append(int(data["rank"]))
                self.finished_at = self.finished_at or time.monotonic()
            # A worker that exits non-zero while the node is stopping is a consequence of the stop,
            # unless its error file says it failed by itself (ranks failing the same way, at once).
            if code != 0 and (not data.get("stopped") or data.get("message")):
                failure = self._worker_failure(host, code, data)
                if not (data.get("stopped") or self.failure is not None):
                    self.fail(failure)
                else:  # arrange_failures decides: the root cause may arrive after its consequences
                    self.others.append(failure)
        elif ev.kind == "leftovers":
            self.leftovers[ev.node] = (host, int(data.get("count", 0)), list(data.get("commands") or ()))
        elif ev.kind == "error":
            self.fail(Failure(2, f"the agent on {host}", f"could not run: {data.get('message')}", None, ()))
        elif ev.kind == "stopping":
            if data.get("reason") in ("signal", "stdin_eof", "parent_died") and not self.stop.stopping:
                detail = f"{data.get('reason')}: {data.get('detail')}"
                self.fail(Failure(1, f"the agent on {host}", f"stopped its workers ({detail})", None, ()))
        elif ev.kind == "done":
            self.done_nodes.add(ev.node)
            code = int(data.get("code", 1))
            if code != 0 and self.failure is None and not self.stop.stopping:
                self.fail(Failure(code, f"the agent on {host}", f"ended with code {code}", None, ()))

    def _worker_failure(self, host: str, code: int, data: Any) -> Failure:
        rank = int(data["rank"])
        worker = self.workers.get(rank)
        local = f" (local rank {worker.local_rank})" if worker else ""
        how = status_text(code, data.get("signal"))
        if data.get("stopped") and data.get("message") and data.get("signal"):
            # it wrote its own error and was exiting when the stop reached it: a failure, not a victim
            how = f"failed as well (the stop reached it while it exited: exit code {code})"
        if data.get("error"):
            how = f"could not start: {data['error']} (exit code {code})"
        tail = tuple(t.decode(errors="replace") for t in self.tails.get(rank, ()))
        text = {k: str(data.get(k) or "") for k in ("message", "hint", "kind", "traceback")}
        return Failure(code, f"rank {rank}{local} on {host}", how, rank, tail, **text)

    def on_foreign(self, handle: AgentHandle, msg: ForeignLine) -> None:
        for node in handle.node_ranks:
            self.node_tails[node].append(msg.text)
        sys.stderr.buffer.write(f"[{handle.name}] ".encode() + msg.text + b"\n")

    def on_eof(self, handle: AgentHandle, status: int | None) -> None:
        lost = [n for n in handle.node_ranks if n not in self.done_nodes]
        if lost and not self.stop.stopping:
            tail = tuple(t.decode(errors="replace") for n in lost for t in self.node_tails[n])
            code = status if status else 255
            how = f"ended without reporting its workers (status {status})"
            self.fail(Failure(code, f"the agent on {handle.name}", how, None, tail))
        elif lost:
            self.done_nodes.update(lost)

    def _note_finished(self, now: float) -> None:
        """Once: some ranks exited 0 a while ago and others still run (see finished_note_s)."""
        since = self.finished_at
        if since is None or now - since < self.options.finished_note_s or self.failure or self.stop.stopping:
            return
        self.finished_at = float("inf")  # said once
        running = sorted(set(self.workers) - self.exited)
        if not running:
            return
        self.say(
            f"rank(s) {rank_ranges(self.finished)} exited with code 0 {now - since:.0f} s ago and rank(s) "
            f"{rank_ranges(running)} still run: if those wait in a collective for the finished ones, they "
            "wait until its timeout; every rank must reach the same collectives (Ctrl-C stops the job)"
        )

    # -- the loop -------------------------------------------------------------------------------
    def _open_logs(self) -> None:
        log_dir = self.options.log_dir
        if not log_dir:
            return
        os.makedirs(log_dir, exist_ok=True)
        suffix = f".restart_{self.plan.attempt}" if self.plan.attempt else ""
        for rank in self.workers:
            self.logs[rank] = open(os.path.join(log_dir, f"rank_{rank}{suffix}.log"), "wb")  # noqa: SIM115

    def _log_tracebacks(self) -> None:
        """Each failed worker's traceback (from its error file) goes to the end of its log file."""
        for failure in [self.failure, *self.others]:
            if failure is None or failure.rank is None:
                continue
            log = self.logs.get(failure.rank)
            if log is not None and failure.traceback:
                body = failure.traceback if failure.traceback.endswith("\n") else failure.traceback + "\n"
                log.write(b"--- dslaunch: traceback from the worker's error file ---\n")
                log.write(body.encode(errors="replace"))

    def run(self, signals: queue.SimpleQueue[int]) -> AttemptResult:
        self._open_logs()
        specs = [
            agent_spec(self.plan, node, grace_period=self.options.grace_period, lifeline=self.runner.lifeline)
            for node in self.plan.nodes
        ]
        self.handles = self.runner.launch(self.plan, specs)
        inbox: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        for i, handle in enumerate(self.handles):
            threading.Thread(target=_read_stream, args=(i, handle, inbox), daemon=True).start()
        open_streams = len(self.handles)
        try:
            while open_streams:
                while not signals.empty():
                    self.on_signal(signals.get())
                now = time.monotonic()
                self._note_finished(now)
                action = self.stop.tick(now)
                if action is StopAction.KILL:
                    self.say("agents did not stop within the grace period: killing")
                    self._act(action)
                killed_at = self.stop.killed_at
                if self.stop.state is StopState.KILLING and killed_at and now > killed_at + _KILL_SLACK_S:
                    names = ", ".join(h.name for h in self.handles)
                    self.say(f"giving up on agents that do not report back (streams: {names})")
                    break
                try:
                    index, item = inbox.get(timeout=0.1)
                except queue.Empty:
                    self.out.flush()
                    continue
                handle = self.handles[index]
                if isinstance(item, OutputLine):
                    self.on_output(item)
                elif isinstance(item, AgentEvent):
                    self.on_event(handle, item)
                elif isinstance(item, ForeignLine):
                    self.on_foreign(handle, item)
                else:  # ("eof", status)
                    open_streams -= 1
                    self.on_eof(handle, item[1])
                if inbox.empty():
                    self.out.flush()
        finally:
            self.stop.finish()
            self.out.flush()
            for h in self.handles:
                h.close()
            self._log_tracebacks()
            for log in self.logs.values():
                log.close()
            line = leftovers_line([self.leftovers[n] for n in sorted(self.leftovers)])
            if line:
                self.say(line)
        failures = tuple(arrange_failures([self.failure, *self.others])) if self.failure is not None else ()
        if self.interrupt_code is not None:
            return AttemptResult(Outcome.INTERRUPTED, self.interrupt_code, self.failure, failures)
        if failures:
            finished = tuple(self.finished)
            return AttemptResult(Outcome.FAILED, failures[0].code, failures[0], failures, finished)
        return AttemptResult(Outcome.SUCCEEDED, 0)


class _Console:
    """The head's stdout for worker lines. If the reader goes away (``dslaunch ... | head``), the job
    goes on (logs still get written) and the output is dropped, said once on stderr."""

    def __init__(self, stream: IO[bytes], say: Callable[[str], None]) -> None:
        self.stream: IO[bytes] | None = stream
        self.say = say

    def _closed(self) -> None:
        self.stream = None
        self.say("stdout is closed: worker output is no longer shown (Ctrl-C stops the job)")

    def write(self, data: bytes) -> None:
        if self.stream is not None:
            try:
                self.stream.write(data)
            except (BrokenPipeError, ValueError):
                self._closed()

    def flush(self) -> None:
        if self.stream is not None:
            try:
                self.stream.flush()
            except (BrokenPipeError, ValueError):
                self._closed()


def _read_stream(index: int, handle: AgentHandle, inbox: queue.SimpleQueue) -> None:
    try:
        for line in iter(handle.readline, b""):
            inbox.put((index, parse_agent_line(line)))
    except Exception as exc:  # a broken transport ends the stream; the head decides what it means
        inbox.put((index, ForeignLine(f"stream error: {exc!r}".encode())))
    status = handle.wait(timeout=10.0)
    inbox.put((index, ("eof", status)))


def print_summary(result: AttemptResult, plan: JobPlan, say: Callable[[str], None]) -> None:
    for line in summary_lines(result.failures, plan.attempt, plan.job_id, finished=result.finished):
        say(line)


def run_job(
    plan_for_attempt: Callable[[int], JobPlan],
    runner: Runner,
    options: SuperviseOptions,
    say: Callable[[str], None],
) -> int:
    """Run the job to the end; returns the launcher's exit code. Installs SIGINT/SIGTERM handlers."""
    signals: queue.SimpleQueue[int] = queue.SimpleQueue()  # put() is safe inside a signal handler
    previous = {s: signal.signal(s, lambda n, _f: signals.put(n)) for s in (signal.SIGINT, signal.SIGTERM)}
    notes: set[str] = set()
    try:
        for attempt in range(options.max_restarts + 1):
            plan = plan_for_attempt(attempt)
            result = _Attempt(plan, runner, options, say, notes).run(signals)
            if result.outcome is Outcome.SUCCEEDED:
                return 0
            if result.outcome is Outcome.INTERRUPTED:
                say(f"interrupted: all workers stopped (exit {result.code})")
                return result.code
            assert result.failure is not None
            print_summary(result, plan, say)
            if attempt < options.max_restarts:
                say(f"restarting all workers (restart {attempt + 1} of {options.max_restarts})")
        return result.code
    finally:
        runner.close()
        for s, handler in previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(s, handler)
