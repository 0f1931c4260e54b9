"""``--launcher openmpi``: the node agents started by Open MPI's mpirun, one per host.

    mpirun [--allow-run-as-root] --np N --host h1:1,h2:1 --map-by ppr:1:node --stdin none
           [--mca plm_rsh_args "-F cfg -p P -o BatchMode=yes"] [--launcher_args]
           PY -m launcher.agent --spec-b64 DATA --node-index-env OMPI_COMM_WORLD_RANK

One slot per host and one process per node make MPI rank i the i-th host of the list, i.e. node rank i
of the plan. The agent does not call MPI: mpirun is only the process starter (its daemons reach the
hosts over ssh with the same settings as the other runners). mpirun forwards SIGTERM to the agents, so a
stop is graceful and every agent reports how its workers ended. See ``launcher.runners.fanout``.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from launcher.agent import EVENT_PREFIX  # noqa: F401 - documents that the agent speaks the same protocol
from launcher.plan import JobPlan
from launcher.runners.fanout import FanoutRunner, ssh_client_args
from launcher.runners.ssh import AGENT_MODULE


def mpirun_command(
    hosts: Sequence[str],
    agent_argv: Sequence[str],
    extra: Mapping[str, Any],
    launcher_args: Sequence[str] = (),
    as_root: bool | None = None,
) -> list[str]:
    """mpirun's argv for one agent per host."""
    as_root = os.geteuid() == 0 if as_root is None else as_root
    argv = ["mpirun"]
    if as_root:
        argv.append("--allow-run-as-root")
    argv += ["--np", str(len(hosts)), "--host", ",".join(f"{h}:1" for h in hosts)]
    argv += ["--map-by", "ppr:1:node", "--stdin", "none"]
    rsh = [a for a in ssh_client_args(extra) if a != "-o" and not a.startswith("BatchMode")]
    if rsh:
        argv += ["--mca", "plm_rsh_args", shlex.join(rsh)]
    return [*argv, *launcher_args, *agent_argv]


class OpenMPIRunner(FanoutRunner):
    name: ClassVar[str] = "openmpi"
    tool: ClassVar[str] = "mpirun"
    install_hint: ClassVar[str] = "apt-get install openmpi-bin"
    stop_mode: ClassVar[str] = "leader"  # mpirun forwards SIGTERM to the agents

    def node_selector(self) -> list[str]:
        return ["--node-index-env", "OMPI_COMM_WORLD_RANK"]

    def command(self, plan: JobPlan, agent_args: list[str], cwd: str) -> tuple[list[str], dict[str, str]]:
        agent = [self.remote_python, "-m", AGENT_MODULE, *agent_args]
        hosts = [n.host for n in plan.nodes]
        argv = mpirun_command(hosts, agent, self.options.extra, self.options.launcher_args)
        return ["mpirun", "--wdir", cwd, *argv[1:]], {}
