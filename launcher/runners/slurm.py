"""``--launcher slurm``: the node agents started by Slurm's srun inside an allocation, one per host.

    SLURM_HOSTFILE=<hosts in plan order> srun --nodes=N --ntasks=N --ntasks-per-node=1
        --distribution=arbitrary --kill-on-bad-exit=1 --export=ALL --chdir=CWD [--launcher_args]
        PY -m launcher.agent --spec-b64 DATA --node-index-env SLURM_PROCID

``--distribution=arbitrary`` with ``SLURM_HOSTFILE`` places task i on the i-th line's host, so the Slurm
task rank is the plan's node rank whatever order Slurm itself sorts nodes in (``SLURM_NODEID`` follows
Slurm's order, which need not be the hostfile's). srun forwards SIGTERM to the agents, so a stop is
graceful. No SSH is involved: srun reaches the nodes through slurmd. See ``launcher.runners.fanout``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from launcher.plan import JobPlan
from launcher.runners.fanout import FanoutRunner
from launcher.runners.ssh import AGENT_MODULE


def srun_command(
    hosts: Sequence[str],
    agent_argv: Sequence[str],
    cwd: str,
    hostfile: str,
    launcher_args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """srun's argv and variables for one agent per host; ``hostfile`` must list ``hosts`` in order."""
    n = str(len(hosts))
    argv = ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", "--distribution=arbitrary",
            "--kill-on-bad-exit=1", "--export=ALL", f"--chdir={cwd}"]  # fmt: skip
    argv += [*launcher_args, *agent_argv]
    return argv, {"SLURM_HOSTFILE": hostfile}


def hostfile_text(hosts: Sequence[str]) -> str:
    return "".join(f"{h}\n" for h in hosts)


class SlurmRunner(FanoutRunner):
    name: ClassVar[str] = "slurm"
    tool: ClassVar[str] = "srun"
    install_hint: ClassVar[str] = "run inside a Slurm allocation on a node with the Slurm client tools"
    stop_mode: ClassVar[str] = "leader"  # srun forwards SIGTERM to the tasks
    uses_ssh: ClassVar[bool] = False

    def node_selector(self) -> list[str]:
        return ["--node-index-env", "SLURM_PROCID"]

    def command(self, plan: JobPlan, agent_args: list[str], cwd: str) -> tuple[list[str], dict[str, str]]:
        hosts = [n.host for n in plan.nodes]
        with tempfile.NamedTemporaryFile(
            "w", prefix=f"dslaunch-{plan.job_id}-", suffix=".hosts", delete=False
        ) as f:
            f.write(hostfile_text(hosts))
        agent = [self.remote_python, "-m", AGENT_MODULE, *agent_args]
        return srun_command(hosts, agent, cwd, str(Path(f.name)), self.options.launcher_args)
