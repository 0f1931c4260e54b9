"""``--launcher slurm``: the node agents started by Slurm's srun inside an allocation, one per host.

    SLURM_HOSTFILE=<hosts in plan order> srun --nodes=N --ntasks=N --ntasks-per-node=1
        --distribution=arbitrary --kill-on-bad-exit=0 --wait=0 --input=all --export=ALL --chdir=CWD
        [--gpus-per-node=K] [--launcher_args]
        PY -m launcher.agent --spec-b64 DATA --node-index-env SLURM_PROCID

``--distribution=arbitrary`` with ``SLURM_HOSTFILE`` places task i on the i-th line's host, so the Slurm
task rank is the plan's node rank whatever order Slurm itself sorts nodes in (``SLURM_NODEID`` follows
Slurm's order, which need not be the hostfile's). The host list is a temporary file, removed when the
job ends. No SSH is involved: srun reaches the nodes through slurmd.

Stopping goes through srun's stdin, which srun copies to every task (``--input=all``): the guard
(``launcher.runners.fanout``, mode ``stdin``) writes the head's ``stop``/``kill`` lines there and every
agent acts on them as it does over SSH, with the grace period. Signals cannot do this: srun turns a
SIGTERM into SIGKILL for the whole step, and any signal it forwards reaches every process of the step,
workers included. srun's stdin is also the agents' lifeline: if srun's stdin closes, they stop. The
head alone decides when a failure ends the job, so a site's ``KillOnBadExit``/``WaitTime`` (which kill
the other nodes at once, or some seconds after the first node finishes) are switched off for the step.

GPUs: a step gets every GPU of the allocation on its nodes, except when the allocation hands GPUs out per
task (``--gpus-per-task``, the srun-per-GPU style): then srun would give the agent's one task one GPU.
In that case the step asks for ``--gpus-per-node`` = the plan's workers per node (the same on every node).

Host names are Slurm node names. A name for this machine (``localhost``, its host name) becomes the node
the head runs on (``SLURMD_NODENAME`` in a batch script, else the short host name). Inside an allocation
every host must belong to it (``SLURM_JOB_NODELIST``), checked before anything starts.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from typing import ClassVar

from launcher.errors import LaunchError
from launcher.plan import JobPlan
from launcher.runners.base import RunnerOptions
from launcher.runners.fanout import FanoutRunner
from launcher.runners.ssh import AGENT_MODULE, is_local_host


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
            "--kill-on-bad-exit=0", "--wait=0", "--input=all", "--export=ALL", f"--chdir={cwd}"]  # fmt: skip
    argv += [*launcher_args, *agent_argv]
    return argv, {"SLURM_HOSTFILE": hostfile}


def hostfile_text(hosts: Sequence[str]) -> str:
    return "".join(f"{h}\n" for h in hosts)


def gpu_request(plan: JobPlan, env: Mapping[str, str]) -> list[str]:
    """srun options that give each agent its node's GPUs, where the allocation's own shape would not."""
    if not env.get("SLURM_GPUS_PER_TASK"):
        return []  # per-node, per-job or no GPUs: the step gets all of the node's by default
    counts = {len(n.slots) for n in plan.nodes}
    if len(counts) != 1:
        raise LaunchError(
            "--launcher slurm: the allocation hands out GPUs per task (--gpus-per-task) and the nodes run "
            "different numbers of workers; allocate with --gpus-per-node instead"
        )
    return [f"--gpus-per-node={counts.pop()}"]


def slurm_node_names(hosts: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """Slurm's name for each plan host: names of this machine become the node the head runs on."""
    this_node = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    return [this_node if is_local_host(h) else h for h in hosts]


def allocation_nodes(env: Mapping[str, str]) -> list[str] | None:
    """The nodes of the allocation the head runs in, or None outside one (or if scontrol cannot say)."""
    nodelist = env.get("SLURM_JOB_NODELIST")
    if not env.get("SLURM_JOB_ID") or not nodelist:
        return None
    try:
        res = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.split() if res.returncode == 0 else None


class SlurmRunner(FanoutRunner):
    name: ClassVar[str] = "slurm"
    tool: ClassVar[str] = "srun"
    install_hint: ClassVar[str] = "run inside a Slurm allocation on a node with the Slurm client tools"
    stop_mode: ClassVar[str] = "stdin"  # srun copies its stdin to every agent: stop/kill lines, EOF
    lifeline: ClassVar[tuple[str, ...]] = ("stdin", "parent")
    uses_ssh: ClassVar[bool] = False

    def __init__(self, options: RunnerOptions) -> None:
        super().__init__(options)
        self._hostfiles: list[str] = []  # one per attempt, removed by close()

    def check(self, plan: JobPlan) -> None:
        super().check(plan)
        gpu_request(plan, os.environ)
        hosts = [n.host for n in plan.nodes]
        allocated = allocation_nodes(os.environ)
        if allocated is None:
            return  # outside an allocation srun makes one (or says why not)
        for host, node in zip(hosts, slurm_node_names(hosts, os.environ), strict=True):
            if node not in allocated:
                what = host if host == node else f"{host} (this machine, Slurm node {node})"
                raise LaunchError(
                    f"--launcher slurm: {what} is not a node of this allocation (job "
                    f"{os.environ['SLURM_JOB_ID']}: {os.environ['SLURM_JOB_NODELIST']}); the hostfile must "
                    f"list the allocation's nodes (scontrol show hostnames)"
                )

    def node_selector(self) -> list[str]:
        return ["--node-index-env", "SLURM_PROCID"]

    def command(self, plan: JobPlan, agent_args: list[str], cwd: str) -> tuple[list[str], dict[str, str]]:
        hosts = slurm_node_names([n.host for n in plan.nodes], os.environ)
        with tempfile.NamedTemporaryFile(
            "w", prefix=f"dslaunch-{plan.job_id}-", suffix=".hosts", delete=False
        ) as f:
            f.write(hostfile_text(hosts))
        self._hostfiles.append(f.name)
        agent = [self.remote_python, "-m", AGENT_MODULE, *agent_args]
        extra = [*gpu_request(plan, os.environ), *self.options.launcher_args]
        return srun_command(hosts, agent, cwd, f.name, extra)

    def close(self) -> None:
        """Remove the host lists (srun has long read them: the job is over)."""
        for path in self._hostfiles:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._hostfiles = []
        super().close()
