"""What the pdsh, OpenMPI and Slurm runners share: one external tool starts every node's agent.

The tool (pdsh, mpirun, srun) carries no stdin to the agents, so the whole job spec travels in argv
(``--spec-b64``, compressed) and each agent picks its node (pdsh: ``--node-host %h``; mpirun/srun: the
tool's rank variable). The agents' lifeline is their parent: when the tool's connection to a host goes,
the agent there is re-parented and stops its workers.

The head never runs the tool directly but under a small *guard* (``python -m launcher.runners.fanout``):
the guard starts the tool in its own session and holds a pipe from the head. ``stop``/``kill`` lines on
that pipe, or its EOF when the head dies (even by SIGKILL), make the guard end the tool the way that
tool needs: mpirun forwards SIGTERM to the agents (a graceful stop with every event reported); srun
would turn it into SIGKILL, so srun gets the ``stop``/``kill`` lines on its stdin instead and copies them
to every agent; pdsh forwards nothing, so the guard ends pdsh's whole process group (pdsh and its ssh
clients) and the agents stop on losing their parent. Without the guard a SIGKILLed head would leave
pdsh's ssh clients, and so the job, running until they next wrote output.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from launcher.agent import encode_spec_arg
from launcher.errors import LaunchError
from launcher.plan import JobPlan
from launcher.runners.base import AgentHandle, PipeAgentHandle
from launcher.runners.ssh import AGENT_MODULE, SSHRunner, forwarded_env, remote_spec

# Linux refuses a single argv string above 128 KiB (MAX_ARG_STRLEN); the remote shell gets the same text.
MAX_COMMAND_BYTES = 120_000


def agent_shell_command(cwd: str, python: str, agent_args: Sequence[str]) -> str:
    """The remote shell command starting the agent (what pdsh/ssh hand to the login shell)."""
    args = " ".join(shlex.quote(a) for a in agent_args)
    return f"cd -- {shlex.quote(cwd)} && exec {shlex.quote(python)} -m {AGENT_MODULE} {args}"


class FanoutHandle(PipeAgentHandle):
    """The guard's stream: every node's agent output through the tool, tool decorations stripped."""

    def __init__(
        self, proc: subprocess.Popen[bytes], node_ranks: tuple[int, ...], name: str, strip: Sequence[str] = ()
    ) -> None:
        super().__init__(proc, node_ranks, name)
        self._strip = {h.encode() + b": " for h in strip}  # pdsh writes "host: " before each line

    def readline(self) -> bytes:
        line = self.stdout.readline()
        if self._strip:
            head, sep, _ = line.partition(b": ")
            if sep and head + sep in self._strip:
                return line[len(head) + 2 :]
        return line


class FanoutRunner(SSHRunner):
    """Base of the pdsh/openmpi/slurm runners. Subclasses build the tool's command line."""

    lifeline: ClassVar[tuple[str, ...]] = ("parent",)
    tool: ClassVar[str]
    install_hint: ClassVar[str]
    stop_mode: ClassVar[str]  # "leader": signal the tool, it forwards; "group": end the tool's group;
    # "stdin": write stop/kill lines to the tool's stdin, which it copies to every agent
    uses_ssh: ClassVar[bool] = True  # preflight the hosts over SSH first (same settings as the tool)

    def check(self, plan: JobPlan) -> None:
        odd = [n.host for n in plan.nodes if "@" in n.host or n.host.count(":") == 1]
        if odd:
            raise LaunchError(
                f"--launcher {self.name}: host {odd[0]!r}: user@ and :port in the hostfile work with "
                f"--launcher ssh only; set User/Port for that host in ssh_config instead"
            )
        v6 = [n.host for n in plan.nodes if n.host.startswith("[")]
        if v6:  # pdsh reads brackets as a host range (node[1-4]); mpirun and srun want names too
            raise LaunchError(
                f"--launcher {self.name}: host {v6[0]!r}: IPv6 addresses in the hostfile work with "
                f"--launcher ssh only; give the host a name (ssh_config Host with HostName, or /etc/hosts)"
            )
        # after the hostfile's forms: a host the tool cannot take is wrong whether or not the tool is here
        if shutil.which(self.tool) is None:
            raise LaunchError(f"--launcher {self.name}: {self.tool} is not installed ({self.install_hint})")
        self.forwarded = forwarded_env(self.options, plan)
        if self.uses_ssh:  # the same checks and messages as --launcher ssh; the tool starts the agents
            self.connect([n.host for n in plan.nodes], plan.cwd)

    def master_addr(self, first_host: str) -> str:
        if not self.uses_ssh:
            return first_host  # scheduler nodes resolve each other by name
        return super().master_addr(first_host)

    def command(self, plan: JobPlan, agent_args: list[str], cwd: str) -> tuple[list[str], dict[str, str]]:
        """The tool's argv and the variables to set for it. ``agent_args`` selects the node by itself."""
        raise NotImplementedError

    def node_selector(self) -> list[str]:
        """Agent arguments that let each agent find its node in the job spec."""
        raise NotImplementedError

    def guard_command(
        self, plan: JobPlan, specs: Sequence[dict[str, Any]]
    ) -> tuple[list[str], dict[str, str]]:
        """The guard's argv (which runs the tool) and the variables the tool needs. No side effects
        beyond what ``command`` writes (Slurm's host list)."""
        fwd = self.forwarded.values if self.forwarded else {}
        job = {
            "version": 1,
            "nodes": [remote_spec(s, fwd, self.remote_python, self.options.python) for s in specs],
        }
        agent_args = ["--spec-b64", encode_spec_arg(job), *self.node_selector()]
        size = len(agent_args[1])
        if size > MAX_COMMAND_BYTES:
            raise LaunchError(
                f"--launcher {self.name}: the job spec makes a {size}-byte command line, more than the "
                f"kernel passes on; use --launcher ssh (spec on stdin) or fewer/shorter variables"
            )
        argv, env = self.command(plan, agent_args, plan.cwd or os.getcwd())
        guard = [self.options.python, "-m", "launcher.runners.fanout", self.stop_mode,
                 str(self.options.grace_period), "--", *argv]  # fmt: skip
        return guard, env

    def launch(self, plan: JobPlan, specs: Sequence[dict[str, Any]]) -> list[AgentHandle]:
        if self.forwarded is None:
            self.check(plan)
        for c in self.conns.values():  # the preflight's connections are not the tool's
            c.close()
        self.conns.clear()
        guard, env = self.guard_command(plan, specs)
        proc = subprocess.Popen(
            guard,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=plan.cwd or os.getcwd(),
            env={**os.environ, **env},
            start_new_session=True,  # Ctrl-C reaches the head only; the head decides
        )
        ranks = tuple(s["node_rank"] for s in specs)
        return [FanoutHandle(proc, ranks, self.name, strip=self.stripped_prefixes(plan))]

    def stripped_prefixes(self, plan: JobPlan) -> Sequence[str]:
        return ()


def merge_env_args(existing: str | None, ours: Sequence[str]) -> str:
    """Append our ssh arguments to a user's existing value instead of replacing it."""
    return " ".join([*(shlex.split(existing) if existing else []), *(shlex.quote(a) for a in ours)])


def ssh_client_args(extra: Mapping[str, Any]) -> list[str]:
    """OpenSSH client arguments equivalent to our SSH settings (for tools that run ``ssh``)."""
    args = ["-o", "BatchMode=yes"]
    if extra.get("ssh_config"):
        args += ["-F", str(extra["ssh_config"])]
    if extra.get("ssh_port"):
        args += ["-p", str(extra["ssh_port"])]
    if extra.get("accept_new_host_keys"):
        args += ["-o", "StrictHostKeyChecking=accept-new"]
    return args


# --- the guard process -----------------------------------------------------------------------------------


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc), children before grandchildren."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop(0)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _become_subreaper() -> None:
    """Orphans of the tool (pdsh's ssh clients once pdsh is gone) re-parent to us, so we can end them."""
    import ctypes

    pr_set_child_subreaper = 36
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)


def guard(stop_mode: str, grace: float, argv: list[str]) -> int:
    """Run ``argv`` in its own session; end it on ``stop``/``kill`` lines, a signal, or stdin EOF.

    ``stop_mode`` "leader": SIGTERM to the tool only (it forwards to the agents); "group": SIGTERM to the
    tool and every descendant; "stdin": a ``stop`` line on the tool's stdin (a ``kill`` line on the second
    request, then SIGKILL 2 s later). Either way SIGKILL to every descendant after ``grace`` + 5 s, and
    the guard returns only when none is left.
    """
    _become_subreaper()
    me = os.getpid()
    by_stdin = stop_mode == "stdin"
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE if by_stdin else subprocess.DEVNULL, start_new_session=True
    )
    requests: deque[str] = deque()

    def read_stdin() -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(0, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                requests.append("stop")  # the head is gone
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip() in (b"stop", b"kill"):
                    requests.append(line.strip().decode())

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: requests.append("stop"))
    threading.Thread(target=read_stdin, daemon=True).start()

    def send(sig: int, everyone: bool) -> None:
        for pid in _descendants(me) if everyone else [proc.pid]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def tell(line: bytes) -> None:
        if proc.stdin is None:  # stop_mode is not "stdin": the tool's stdin is /dev/null
            return
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.write(line)
            proc.stdin.flush()

    kill_at = None
    while True:
        while requests:
            req = requests.popleft()
            escalate = req == "kill" or kill_at is not None  # a second request escalates
            if by_stdin:
                tell(b"kill\n" if escalate else b"stop\n")
                # "kill" needs the tool alive to pass it on; the agents report, then the tool goes.
                due = time.monotonic() + (2.0 if escalate else grace + 5.0)
                kill_at = due if kill_at is None else min(kill_at, due)
            elif escalate:
                kill_at = time.monotonic()
            else:
                send(signal.SIGTERM, everyone=stop_mode == "group")
                # The agents have their own grace period; give the tool that much and a little more.
                kill_at = time.monotonic() + grace + 5.0
        if kill_at is not None and time.monotonic() >= kill_at:
            send(signal.SIGKILL, everyone=True)
        for child in _descendants(me):  # reap adopted orphans (never the tool: Popen reaps it)
            if child != proc.pid:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(child, os.WNOHANG)
        if proc.poll() is not None:
            if not _descendants(me):
                break
            if kill_at is None:  # the tool ended but left processes behind: a short grace, then kill
                kill_at = time.monotonic() + 2.0
        time.sleep(0.05)
    rc = proc.returncode
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    mode, grace_s, sep, *cmd = sys.argv[1:]
    if mode not in ("leader", "group", "stdin") or sep != "--" or not cmd:
        print("usage: python -m launcher.runners.fanout leader|group|stdin GRACE -- argv...", file=sys.stderr)
        sys.exit(2)
    os._exit(guard(mode, float(grace_s), cmd))
