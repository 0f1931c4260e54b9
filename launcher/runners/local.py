"""The local runner: the node agent as a plain subprocess of the head, on this machine.

The agent gets its spec as the first line of its stdin and keeps that pipe as its lifeline: if the head
dies, even by SIGKILL, the pipe closes and the agent stops its workers. It runs in its own session, so a
Ctrl-C in the terminal reaches only the head, which then decides (stop, then kill on a second Ctrl-C).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Sequence
from typing import Any, ClassVar

from launcher.errors import LaunchError
from launcher.plan import JobPlan
from launcher.runners.base import AgentHandle, Runner


class LocalAgentHandle(AgentHandle):
    def __init__(self, proc: subprocess.Popen, node_rank: int, name: str) -> None:
        self.proc = proc
        self.node_ranks = (node_rank,)
        self.name = name

    def _command(self, cmd: bytes, fallback: signal.Signals) -> None:
        try:
            self.proc.stdin.write(cmd)
            self.proc.stdin.flush()
        except (OSError, ValueError):  # pipe gone or closed: fall back to a signal
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(fallback)

    def readline(self) -> bytes:
        return self.proc.stdout.readline()

    def stop(self) -> None:
        self._command(b"stop\n", signal.SIGTERM)

    def kill(self) -> None:
        self._command(b"kill\n", signal.SIGTERM)  # the agent treats a second signal as "kill"

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        return rc if rc >= 0 else 128 - rc

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()


class LocalRunner(Runner):
    name: ClassVar[str] = "local"

    def check(self, plan: JobPlan) -> None:
        if len(plan.nodes) != 1:
            hosts = ", ".join(n.host for n in plan.nodes)
            raise LaunchError(f"--launcher local runs one host, the plan has {len(plan.nodes)}: {hosts}")

    def launch(self, plan: JobPlan, specs: Sequence[dict[str, Any]]) -> list[AgentHandle]:
        handles = []
        for spec in specs:
            proc = subprocess.Popen(
                self.agent_argv(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=plan.cwd,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            proc.stdin.write(json.dumps(spec, separators=(",", ":")).encode() + b"\n")
            proc.stdin.flush()
            handles.append(LocalAgentHandle(proc, spec["node_rank"], spec["host"]))
        return handles
