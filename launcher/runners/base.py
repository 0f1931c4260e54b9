"""The runner interface: how the head starts node agents and reads what they say.

A *runner* starts the node agent (``launcher.agent``, whose module docstring defines the spec and the
line protocol) once per ``NodePlan`` by some transport -- a local subprocess, an SSH channel, pdsh,
mpirun, srun -- and returns one ``AgentHandle`` per stream it reads. The supervisor
(``launcher.supervisor``) then, for every handle, in one reader thread each:

1. calls ``readline()`` until it returns ``b""`` (EOF), parsing each line with ``parse_agent_line``;
2. after EOF, calls ``wait(timeout)`` for the transport's exit status.

From the main thread, at any time, it may call ``stop()`` (graceful: the agents SIGTERM their workers,
wait their grace period, then SIGKILL), ``kill()`` (SIGKILL now; after ``stop``, on a second Ctrl-C)
and, at the end, ``close()``. ``stop``/``kill``/``close`` must be idempotent, must not block for long
and must be safe to call while another thread sits in ``readline``.

A handle usually carries one agent (one node). Fan-out runners (pdsh, mpirun, srun) may carry several
nodes in one stream: each protocol line names its rank or node, so ``AgentHandle.node_ranks`` lists
every node whose agent writes to that stream, and the runner strips transport decorations (such as
pdsh's ``host: `` prefix) in ``readline`` so the agent's lines come out intact.

Runner contract:

* ``Runner.check(plan)``: everything that can be verified before starting anything (tool installed,
  hosts reachable, ...). Raise ``LaunchError`` with one clear line; the CLI exits 2.
* ``Runner.launch(plan, specs)``: start the agents, ``specs[i]`` (from ``agent_spec``) being the node
  spec for ``plan.nodes[i]``. ``Runner.lifeline`` is what the supervisor puts in the specs: a runner
  that keeps the agent's stdin open for the life of the job uses ``("stdin", "parent")``; one whose
  transport has no stdin (pdsh, mpirun, srun) uses ``("parent",)`` and passes the spec in argv
  (``launcher.agent.encode_spec_arg``).
* ``Runner.master_addr(first_host)``: MASTER_ADDR when the user gave none (multi-node jobs).
* ``Runner.close()``: called once after the last attempt (the runner may keep connections between
  restart attempts).
* If a runner fails to start a node after starting others, it stops the ones it started before raising.

Output labels (``[rank N]`` or ``[host rank N]``) come from ``WorkerPlan.label``; runners never format.
"""

from __future__ import annotations

import abc
import contextlib
import json
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, ClassVar

from launcher.agent import EVENT_PREFIX, PROTOCOL_VERSION
from launcher.plan import JobPlan, NodePlan


# -- the protocol, head side ---------------------------------------------------------------------
@dataclass(frozen=True)
class OutputLine:
    """One line of a worker's output (no newline), undecoded."""

    rank: int
    text: bytes


@dataclass(frozen=True)
class AgentEvent:
    """One ``@dslaunch {...}`` line: ``kind`` is its ``ev``, ``node`` its node rank, ``data`` all fields."""

    kind: str
    node: int
    data: Mapping[str, Any]


@dataclass(frozen=True)
class ForeignLine:
    """A line that is not protocol: an agent crash traceback, transport noise (no newline)."""

    text: bytes


AgentMessage = OutputLine | AgentEvent | ForeignLine


def parse_agent_line(line: bytes) -> AgentMessage:
    """Classify one raw line of an agent stream (with or without its trailing newline)."""
    if line.endswith(b"\n"):
        line = line[:-1]
    head, sep, rest = line.partition(b":")
    if sep and head.isdigit():
        return OutputLine(int(head), rest)
    if line.startswith(EVENT_PREFIX):
        try:
            data = json.loads(line[len(EVENT_PREFIX) :])
        except ValueError:
            return ForeignLine(line)
        if isinstance(data, dict) and isinstance(data.get("ev"), str):
            return AgentEvent(data["ev"], int(data.get("node", -1)), data)
    return ForeignLine(line)


def agent_spec(
    plan: JobPlan,
    node: NodePlan,
    *,
    grace_period: float,
    lifeline: Sequence[str] = ("stdin", "parent"),
    log_dir: str | None = None,
) -> dict[str, Any]:
    """The agent's node spec for ``node``: variables shared by all its workers go to the node level."""
    envs = [w.env for w in node.workers]
    shared = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs[1:])} if envs else {}
    return {
        "version": PROTOCOL_VERSION,
        "job_id": plan.job_id,
        "node_rank": node.node_rank,
        "host": node.host,
        "env": shared,
        "env_defaults": dict(node.env_defaults),
        "omp_threads_auto": node.omp_threads_auto,
        "cwd": plan.cwd,
        "log_dir": log_dir,
        "grace_period": grace_period,
        "lifeline": list(lifeline),
        "workers": [
            {
                "rank": w.rank,
                "local_rank": w.local_rank,
                "argv": list(w.argv),
                "env": {k: v for k, v in w.env.items() if shared.get(k) != v},
                "cwd": None,
            }
            for w in node.workers
        ],
    }


# -- the interface ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunnerOptions:
    """Settings every runner receives. ``extra`` carries runner-specific options by name."""

    python: str  # absolute interpreter path for the agent (the head's, as DeepSpeed does)
    grace_period: float = 5.0
    launcher_args: tuple[str, ...] = ()  # shlex-split --launcher_args, for the transport tool
    env: Mapping[str, str] = field(default_factory=dict)  # --env K=V (already in every worker's env)
    extra: Mapping[str, Any] = field(default_factory=dict)


class AgentHandle(abc.ABC):
    """One stream of agent protocol lines and the means to stop what produces it."""

    #: node ranks whose agent writes to this stream
    node_ranks: tuple[int, ...]
    #: what to call the stream in messages ("localhost", "worker1", "pdsh")
    name: str

    @abc.abstractmethod
    def readline(self) -> bytes:
        """The next raw line, newline included; ``b""`` at EOF. Called from one reader thread."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Ask the agents to stop gracefully (``stop`` command, closing stdin, or a signal)."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Ask the agents to SIGKILL their workers now."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> int | None:
        """Exit status of the agent/transport (128+signal if it was killed), None if still running."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the transport (pipes, channels). Called once the stream is finished."""


class PipeAgentHandle(AgentHandle):
    """An agent stream read from a local subprocess (the agent itself, or a tool that fans out to agents),
    controlled through its stdin; when the pipe is gone, a signal to the process does the same."""

    def __init__(self, proc: subprocess.Popen[bytes], node_ranks: tuple[int, ...], name: str) -> None:
        if proc.stdin is None or proc.stdout is None:
            raise ValueError("PipeAgentHandle needs a process started with stdin and stdout as PIPE")
        self.proc = proc
        self.stdin: IO[bytes] = proc.stdin
        self.stdout: IO[bytes] = proc.stdout
        self.node_ranks = node_ranks
        self.name = name

    def _command(self, cmd: bytes) -> None:
        try:
            self.stdin.write(cmd)
            self.stdin.flush()
        except (OSError, ValueError):  # pipe gone or closed: fall back to a signal
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)  # a second SIGTERM means "kill" to the agent

    def readline(self) -> bytes:
        return self.stdout.readline()

    def stop(self) -> None:
        self._command(b"stop\n")

    def kill(self) -> None:
        self._command(b"kill\n")

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        return rc if rc >= 0 else 128 - rc

    def close(self) -> None:
        for stream in (self.stdin, self.stdout):
            with contextlib.suppress(OSError):
                stream.close()


class Runner(abc.ABC):
    """Starts node agents. Subclasses register in ``launcher.runners.RUNNERS`` under ``name``."""

    name: ClassVar[str]
    lifeline: ClassVar[tuple[str, ...]] = ("stdin", "parent")

    def __init__(self, options: RunnerOptions) -> None:
        self.options = options

    def check(self, plan: JobPlan) -> None:  # noqa: B027 - optional hook
        """Raise ``LaunchError`` for anything that would make ``launch`` fail; start nothing."""

    @abc.abstractmethod
    def launch(self, plan: JobPlan, specs: Sequence[dict[str, Any]]) -> list[AgentHandle]:
        """Start one agent per node spec; return the handles covering every node exactly once."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the runner holds across attempts (connections); called once, at the end."""

    def master_addr(self, first_host: str) -> str:
        """MASTER_ADDR when --master_addr is not given: an address of the first node that every node
        can reach. The default is the host name itself; remote runners may resolve ssh aliases."""
        return first_host

    def agent_argv(self) -> list[str]:
        """The agent's command line (interpreter path from the options)."""
        return [self.options.python, "-m", "launcher.agent"]
