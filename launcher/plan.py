"""The launch plan: who runs where, with which rank, argv and environment. Pure functions only.

``make_plan(hosts, job, attempt)`` turns the resolved hosts (``HostSlots``, from ``launcher.hostfile``)
and the job settings (``JobConfig``, from the CLI) into a ``JobPlan``: one ``NodePlan`` per host with at
least one slot, in hostfile order, each holding its ``WorkerPlan``s. Nothing here reads the process
environment, touches the file system or starts a process, so every rule is unit-tested directly.

Ranks: global ranks are numbered in host order, then slot order. ``LOCAL_RANK`` is the index of the
worker on its node (0..n-1), also when nodes have different slot counts.

Every worker's environment (``WorkerPlan.env``, set over what the agent inherits):

=============================  ===============================================================
RANK, WORLD_SIZE               global rank and number of workers
LOCAL_RANK, LOCAL_WORLD_SIZE   index on this node and workers on this node (LOCAL_SIZE: same)
NODE_RANK, GROUP_RANK          index of the node; CROSS_RANK too (DeepSpeed's name)
CROSS_SIZE, GROUP_WORLD_SIZE   number of nodes
MASTER_ADDR, MASTER_PORT       rendezvous of rank 0
TORCHELASTIC_RESTART_COUNT     attempt number, 0 first (also DSLAUNCH_ATTEMPT)
TORCHELASTIC_MAX_RESTARTS      --max_restarts
TORCHELASTIC_RUN_ID            the job id (also DSLAUNCH_JOB_ID)
CUDA_VISIBLE_DEVICES           the node's slot list, when the node's slots are GPUs
--env K=V                      the user's variables, on every worker
=============================  ===============================================================

Defaults the agent applies only where the node's environment lacks them (``NodePlan.env_defaults``):
``NCCL_NVLS_ENABLE=0`` (NVLink multicast needs fabric setup most machines lack; NCCL then fails at
init). ``OMP_NUM_THREADS``, when unset and a node runs several workers, becomes usable CPUs // workers
on that node (``NodePlan.omp_threads_auto``; torchrun uses 1, which starves CPU training).

Arguments: ``python -u script --local_rank=N user_args...`` (the position DeepSpeed uses), ``python -u
-m module ...`` with ``module``, or ``script ...`` with ``no_python``; ``--local_rank=N`` is left out
with ``no_local_rank``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from launcher.errors import LaunchError

# Variables the plan owns: a user may not set them with --env (the job would disagree with itself).
PLAN_ENV_KEYS = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "LOCAL_SIZE",
        "NODE_RANK",
        "GROUP_RANK",
        "CROSS_RANK",
        "CROSS_SIZE",
        "GROUP_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID",
        "DSLAUNCH_ATTEMPT",
        "DSLAUNCH_JOB_ID",
    }
)

NODE_ENV_DEFAULTS: Mapping[str, str] = MappingProxyType({"NCCL_NVLS_ENABLE": "0"})


def _frozen(d: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class HostSlots:
    """One host after filtering: its name, the slots (device ids) to use, and what the slots are."""

    host: str
    slots: tuple[int, ...]
    gpus: bool = True  # slots are GPU ids: set CUDA_VISIBLE_DEVICES
    local: bool = False  # this machine: output labels leave the host name out when it is the only node


@dataclass(frozen=True)
class JobConfig:
    """What to run and how; everything the CLI decided that is the same for every worker."""

    script: str
    script_args: tuple[str, ...] = ()
    python: str = "python3"
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    job_id: str = "job"
    max_restarts: int = 0
    cwd: str | None = None
    user_env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerPlan:
    rank: int
    local_rank: int
    node_rank: int
    host: str
    label: str  # output prefix without brackets: "rank 3" or "worker1 rank 3"
    argv: tuple[str, ...]
    env: Mapping[str, str]


@dataclass(frozen=True)
class NodePlan:
    node_rank: int
    host: str
    slots: tuple[int, ...]
    gpus: bool
    workers: tuple[WorkerPlan, ...]
    env_defaults: Mapping[str, str]
    omp_threads_auto: bool


@dataclass(frozen=True)
class JobPlan:
    job_id: str
    attempt: int
    max_restarts: int
    master_addr: str
    master_port: int
    world_size: int
    cwd: str | None
    nodes: tuple[NodePlan, ...]

    @property
    def workers(self) -> tuple[WorkerPlan, ...]:
        return tuple(w for node in self.nodes for w in node.workers)


def worker_argv(job: JobConfig, local_rank: int) -> tuple[str, ...]:
    """The command line of one worker."""
    extra = () if job.no_local_rank else (f"--local_rank={local_rank}",)
    if job.no_python:
        head: tuple[str, ...] = (job.script,)
    elif job.module:
        head = (job.python, "-u", "-m", job.script)
    else:
        head = (job.python, "-u", job.script)
    return (*head, *extra, *job.script_args)


def _check(hosts: Sequence[HostSlots], job: JobConfig, attempt: int) -> None:
    if job.module and job.no_python:
        raise LaunchError("--module and --no_python cannot be used together")
    if not 1 <= job.master_port <= 65535:
        raise LaunchError(f"--master_port {job.master_port}: not a TCP port (1-65535)")
    if not 0 <= attempt <= job.max_restarts:
        raise LaunchError(f"attempt {attempt} is outside 0..{job.max_restarts} (--max_restarts)")
    owned = sorted(PLAN_ENV_KEYS.intersection(job.user_env))
    if owned:
        raise LaunchError(f"--env {owned[0]}=...: {owned[0]} is set by dslaunch for every worker")
    names = [h.host for h in hosts]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise LaunchError(f"host {dup!r} appears twice in the plan")
    if not any(h.slots for h in hosts):
        raise LaunchError("no workers to start: every host has 0 slots")


def make_plan(hosts: Sequence[HostSlots], job: JobConfig, attempt: int = 0) -> JobPlan:
    """Assign ranks and build every worker's argv and environment. Hosts with no slots are skipped."""
    _check(hosts, job, attempt)
    used = [h for h in hosts if h.slots]
    world_size = sum(len(h.slots) for h in used)
    n_nodes = len(used)
    show_host = n_nodes > 1 or not used[0].local
    common = {
        "WORLD_SIZE": str(world_size),
        "CROSS_SIZE": str(n_nodes),
        "GROUP_WORLD_SIZE": str(n_nodes),
        "MASTER_ADDR": job.master_addr,
        "MASTER_PORT": str(job.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(job.max_restarts),
        "TORCHELASTIC_RUN_ID": job.job_id,
        "DSLAUNCH_ATTEMPT": str(attempt),
        "DSLAUNCH_JOB_ID": job.job_id,
    }
    nodes = []
    rank = 0
    for node_rank, h in enumerate(used):
        n_local = len(h.slots)
        node_env = {
            **job.user_env,
            **common,
            "NODE_RANK": str(node_rank),
            "GROUP_RANK": str(node_rank),
            "CROSS_RANK": str(node_rank),
            "LOCAL_WORLD_SIZE": str(n_local),
            "LOCAL_SIZE": str(n_local),
        }
        if h.gpus:
            node_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in h.slots)
        workers = []
        for local_rank in range(n_local):
            env = {**node_env, "RANK": str(rank), "LOCAL_RANK": str(local_rank)}
            label = f"{h.host} rank {rank}" if show_host else f"rank {rank}"
            workers.append(
                WorkerPlan(
                    rank=rank,
                    local_rank=local_rank,
                    node_rank=node_rank,
                    host=h.host,
                    label=label,
                    argv=worker_argv(job, local_rank),
                    env=_frozen(env),
                )
            )
            rank += 1
        nodes.append(
            NodePlan(
                node_rank=node_rank,
                host=h.host,
                slots=h.slots,
                gpus=h.gpus,
                workers=tuple(workers),
                env_defaults=_frozen({k: v for k, v in NODE_ENV_DEFAULTS.items() if k not in job.user_env}),
                omp_threads_auto=n_local > 1 and "OMP_NUM_THREADS" not in job.user_env,
            )
        )
    return JobPlan(
        job_id=job.job_id,
        attempt=attempt,
        max_restarts=job.max_restarts,
        master_addr=job.master_addr,
        master_port=job.master_port,
        world_size=world_size,
        cwd=job.cwd,
        nodes=tuple(nodes),
    )
