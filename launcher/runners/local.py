"""The local runner: the node agent as a plain subprocess of the head, on this machine.

The agent gets its spec as the first line of its stdin and keeps that pipe as its lifeline: if the head
dies, even by SIGKILL, the pipe closes and the agent stops its workers. It runs in its own session, so a
Ctrl-C in the terminal reaches only the head, which then decides (stop, then kill on a second Ctrl-C).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from typing import Any, ClassVar

from launcher.errors import LaunchError
from launcher.plan import JobPlan
from launcher.runners.base import AgentHandle, PipeAgentHandle, Runner


class LocalRunner(Runner):
    name: ClassVar[str] = "local"

    def check(self, plan: JobPlan) -> None:
        if len(plan.nodes) != 1:
            hosts = ", ".join(n.host for n in plan.nodes)
            raise LaunchError(f"--launcher local runs one host, the plan has {len(plan.nodes)}: {hosts}")

    def launch(self, plan: JobPlan, specs: Sequence[dict[str, Any]]) -> list[AgentHandle]:
        handles: list[AgentHandle] = []
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
            handle = PipeAgentHandle(proc, (spec["node_rank"],), spec["host"])
            handle.stdin.write(json.dumps(spec, separators=(",", ":")).encode() + b"\n")
            handle.stdin.flush()
            handles.append(handle)
        return handles
