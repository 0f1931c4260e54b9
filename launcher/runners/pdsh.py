"""``--launcher pdsh``: the node agents started by pdsh over ssh, one per host.

    pdsh -S -b -R ssh -f <hosts> -w h1,h2 [--launcher_args] 'cd -- CWD && exec PY -m launcher.agent
         --spec-b64 DATA --node-host %h'

pdsh substitutes ``%h`` with each target's name, so an agent finds its node by the hostfile name (pdsh's
``%n`` follows pdsh's own host ordering, which need not be the hostfile's). ``-S`` makes pdsh exit with
the largest remote exit code. SSH settings reach pdsh's ssh through ``PDSH_SSH_ARGS_APPEND`` (``-F``,
``-p``, BatchMode), appended to whatever the user already has there rather than replacing it.
See ``launcher.runners.fanout`` for the guard that stops pdsh and for the lifeline.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from launcher.plan import JobPlan
from launcher.runners.fanout import FanoutRunner, agent_shell_command, merge_env_args, ssh_client_args


def pdsh_command(
    hosts: Sequence[str],
    remote_command: str,
    extra: Mapping[str, Any],
    launcher_args: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """pdsh's argv and the variables to set for it."""
    environ = os.environ if environ is None else environ
    argv = ["pdsh", "-S", "-b", "-R", "ssh", "-f", str(max(1, len(hosts))), "-w", ",".join(hosts)]
    argv += [*launcher_args, remote_command]
    env = {
        "PDSH_RCMD_TYPE": "ssh",
        "PDSH_SSH_ARGS_APPEND": merge_env_args(environ.get("PDSH_SSH_ARGS_APPEND"), ssh_client_args(extra)),
    }
    return argv, env


class PDSHRunner(FanoutRunner):
    name: ClassVar[str] = "pdsh"
    tool: ClassVar[str] = "pdsh"
    install_hint: ClassVar[str] = "apt-get install pdsh"
    stop_mode: ClassVar[str] = "group"  # pdsh does not forward signals: end pdsh and its ssh clients

    def node_selector(self) -> list[str]:
        return ["--node-host", "%h"]

    def command(self, plan: JobPlan, agent_args: list[str], cwd: str) -> tuple[list[str], dict[str, str]]:
        remote = agent_shell_command(cwd, self.remote_python, agent_args)
        # "%h" must reach pdsh unquoted: shlex.quote leaves it alone (no shell-special characters).
        return pdsh_command(
            [n.host for n in plan.nodes], remote, self.options.extra, self.options.launcher_args
        )

    def stripped_prefixes(self, plan: JobPlan) -> Sequence[str]:
        return [n.host for n in plan.nodes]
