"""Process-group setup from the environment, whoever started the process.

Reads the rank layout that dslaunch, torchrun, Slurm (srun) or Open MPI / MPICH (mpirun) put in the
environment, creates the default process group (nccl with CUDA, gloo without), and picks this process's
device from LOCAL_RANK. Without any of those variables it is a one-process world, so `python train.py`
works unchanged. `resolve_dist_env` is pure (a mapping in, a `DistEnv` out) and unit-tested.

`DS_ACCELERATOR` (DeepSpeed's name) chooses the device kind: `cpu` trains on CPU with gloo even where
CUDA is visible (debugging, CPU-only comparisons, tests on a GPU machine), `cuda` insists on a GPU;
unset means CUDA when torch sees a device, else CPU.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from runtime.errors import UserError, release_torch_rank_prefix

_log = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500
GLOO_EXIT_GRACE_S = 0.1
"""How long a gloo process waits at exit, the interpreter still whole, for the backend's worker threads
(`_let_gloo_workers_finish`)."""
ACCELERATOR_ENV = "DS_ACCELERATOR"


class DistEnvError(UserError, RuntimeError):
    """The environment describes an impossible or incomplete rank layout, or its rendezvous fails."""

    hint = (
        "check the variables the launcher set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), "
        "or start the script with dslaunch"
    )


@dataclass(frozen=True)
class DistEnv:
    """The rank layout of this process, and where it came from."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None  # None: one-process world, no rendezvous needed
    master_port: int
    source: str  # "env", "slurm", "openmpi", "pmi" or "single-process"


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise DistEnvError(f"environment variable {name}={value!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """The first hostname of a Slurm node list: "gpu[03-05,09],cpu1" -> "gpu03"."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise DistEnvError(f"cannot read a host name from SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def resolve_dist_env(env: Mapping[str, str]) -> DistEnv:
    """Read the rank layout from environment variables.

    Precedence: explicit RANK/WORLD_SIZE (dslaunch, torchrun, or the user), then Open MPI
    (OMPI_COMM_WORLD_*), MPICH/Intel MPI (PMI_RANK/PMI_SIZE), then Slurm (SLURM_PROCID/SLURM_NTASKS).
    Without any of them: a one-process world.
    """
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_MASTER_PORT
    addr = env.get("MASTER_ADDR")
    if "RANK" in env or "WORLD_SIZE" in env:
        missing = [n for n in ("RANK", "WORLD_SIZE") if n not in env]
        if missing:
            raise DistEnvError(f"RANK and WORLD_SIZE must be set together; {missing[0]} is missing")
        rank, world, source = _int(env, "RANK"), _int(env, "WORLD_SIZE"), "env"
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else None
    elif "OMPI_COMM_WORLD_RANK" in env:
        rank, world, source = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE"), "openmpi"
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else None
        if addr is None and env.get("OMPI_COMM_WORLD_LOCAL_SIZE") == env.get("OMPI_COMM_WORLD_SIZE"):
            addr = "127.0.0.1"  # every rank on this host
    elif "PMI_RANK" in env:
        rank, world, source = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE"), "pmi"
        local = _int(env, "MPI_LOCALRANKID") if "MPI_LOCALRANKID" in env else None
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world, source = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), "slurm"
        local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else None
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if addr is None and nodelist:
            addr = first_slurm_host(nodelist)
    else:
        return DistEnv(
            0, 1, _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0, addr, port, "single-process"
        )

    if world < 1 or not 0 <= rank < world:
        raise DistEnvError(f"rank {rank} is not in [0, world size {world}) (from {source} variables)")
    if local is None:
        local = rank if world == 1 else _local_rank_guess(env, rank)
    if world > 1 and addr is None:
        raise DistEnvError(
            f"MASTER_ADDR is not set ({source} gave rank {rank} of {world}); "
            "export MASTER_ADDR=<rank-0 host> "
            "(with mpirun: -x MASTER_ADDR=... -x MASTER_PORT=...)"
        )
    return DistEnv(rank, world, local, addr, port, source)


LOCAL_SIZE_VARIABLES = (
    "LOCAL_WORLD_SIZE",  # dslaunch, torchrun
    "OMPI_COMM_WORLD_LOCAL_SIZE",  # Open MPI
    "MPI_LOCALNRANKS",  # MPICH, Intel MPI
    "SLURM_NTASKS_PER_NODE",  # srun
)


def local_world_size(env: Mapping[str, str] | None = None) -> int:
    """How many ranks of the job run on this host, from the first launcher variable that is set (1
    without any): what a rank sizing its share of the host's memory must divide by."""
    env = os.environ if env is None else env
    for name in LOCAL_SIZE_VARIABLES:
        if env.get(name, "").strip():
            # Slurm may write "4(x2)" (4 tasks on each of 2 nodes): the count comes first
            value = re.match(r"\s*(\d+)", env[name])
            if value is None or int(value.group(1)) < 1:
                raise DistEnvError(f"environment variable {name}={env[name]!r} is not a rank count")
            return int(value.group(1))
    return 1


def _local_rank_guess(env: Mapping[str, str], rank: int) -> int:
    if "LOCAL_WORLD_SIZE" in env:
        return rank % _int(env, "LOCAL_WORLD_SIZE")
    raise DistEnvError(
        f"LOCAL_RANK is not set for rank {rank}; the runtime needs it to pick this process's device"
    )


def accelerator() -> str:
    """The device kind this process trains on, "cuda" or "cpu" (see the module docstring)."""
    chosen = os.environ.get(ACCELERATOR_ENV, "").strip().lower()
    if chosen not in ("", "cuda", "cpu"):
        raise DistEnvError(f"{ACCELERATOR_ENV}={chosen!r} is not supported here; use 'cuda' or 'cpu'")
    if chosen == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if chosen == "cuda":
        raise DistEnvError(f"{ACCELERATOR_ENV}=cuda, but torch sees no CUDA device in this process")
    return "cpu"


def device_for(local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK when training on CUDA (`accelerator()`), else cpu.

    A process that sees exactly one GPU uses it whatever its LOCAL_RANK (Slurm's --gpus-per-task and
    similar bindings give each process its own CUDA_VISIBLE_DEVICES).
    """
    if accelerator() == "cuda":
        count = torch.cuda.device_count()
        if local_rank < count:
            return torch.device("cuda", local_rank)
        if count == 1:
            return torch.device("cuda", 0)
        raise DistEnvError(
            f"LOCAL_RANK={local_rank} but only {count} CUDA devices are visible to this process"
        )
    return torch.device("cpu")


def current_device() -> torch.device:
    """This process's device: cuda:LOCAL_RANK (or the current CUDA device when LOCAL_RANK is unset, e.g.
    a process group created by hand), else cpu."""
    if "LOCAL_RANK" in os.environ:
        return device_for(_int(os.environ, "LOCAL_RANK"))
    if accelerator() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(dist_backend: str | None = None, timeout: timedelta | None = None) -> None:
    """Create the default process group from the environment; a no-op when one exists.

    Args:
        dist_backend: "nccl", "gloo", ...; default nccl when CUDA is available, else gloo.
        timeout: collective timeout (torch's default when None).
    """
    if dist.is_initialized():  # the script's own group: its exit needs the same care
        _guard_exit(dist.get_backend())
        release_torch_rank_prefix()
        return
    env = resolve_dist_env(os.environ)
    device = device_for(env.local_rank)
    backend = dist_backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs: dict = {"backend": backend, "rank": env.rank, "world_size": env.world_size}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if env.world_size == 1 and env.master_addr is None:
        # `python train.py`: no rendezvous, no port to collide with other jobs.
        kwargs["store"] = dist.HashStore()
    else:
        # Slurm and mpirun do not set these names; env:// and torch's own helpers read them.
        os.environ.setdefault("MASTER_ADDR", str(env.master_addr))
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        for name, value in (
            ("RANK", env.rank),
            ("WORLD_SIZE", env.world_size),
            ("LOCAL_RANK", env.local_rank),
        ):
            os.environ.setdefault(name, str(value))
        # env:// (not tcp://) so a torchrun worker joins the agent's store instead of opening its own
        kwargs["init_method"] = "env://"
    _log.debug("init_process_group %s (rank %d/%d from %s)", backend, env.rank, env.world_size, env.source)
    try:
        dist.init_process_group(**kwargs)
    except dist.DistNetworkError as error:
        raise rendezvous_error(env, str(error)) from error
    _guard_exit(backend)
    release_torch_rank_prefix()  # its [rankN]: label would double dslaunch's [rank N]


def rendezvous_error(env: DistEnv, detail: str) -> DistEnvError:
    """torch's network error at the rendezvous, said in terms of MASTER_ADDR/MASTER_PORT and the flag to
    change. `detail` is torch's message (its first line is kept at the end for the curious)."""
    where = f"MASTER_ADDR:MASTER_PORT ({env.master_addr}:{env.master_port})"
    first = detail.strip().splitlines()[0] if detail.strip() else "no detail"
    lowered = detail.lower()
    hint = (
        "pass --master_port with a free port to dslaunch (needed for multi-node jobs); with another "
        "launcher, export MASTER_PORT=<free port>"
    )
    if "eaddrinuse" in lowered or "address already in use" in lowered:
        return DistEnvError(
            f"rank {env.rank} cannot open the rendezvous at {where}: the port is already in use on this "
            f"host, by another job or process ({first})",
            hint=hint,
        )
    if "listen" in lowered or "bind" in lowered:
        return DistEnvError(
            f"rank {env.rank} cannot open the rendezvous at {where} on this host ({first})", hint=hint
        )
    return DistEnvError(
        f"rank {env.rank} cannot reach the rendezvous at {where}: nothing answered there ({first})",
        hint="check that MASTER_ADDR is rank 0's host and reachable from this one, that rank 0 is running, "
        "and that no firewall blocks MASTER_PORT; if the port was busy on rank 0's host, pass --master_port "
        "with a free port (multi-node jobs)",
    )


_exit_guarded = False


def _guard_exit(backend: str) -> None:
    global _exit_guarded
    if "gloo" in str(backend) and not _exit_guarded:  # "gloo", or "cpu:gloo,cuda:nccl"
        atexit.register(_let_gloo_workers_finish)
        _exit_guarded = True


def _let_gloo_workers_finish() -> None:
    """At exit: give gloo's worker threads the GIL for a moment before the interpreter shuts down.

    A gloo worker thread drops its reference to a finished collective after the caller's `wait()` has
    already returned. If that is the last reference, the collective's tensors are freed on the worker
    thread, which needs the GIL for their Python objects. Should the interpreter be finalizing by then
    (a script whose last act is a collective, such as a checkpoint's, and which exits right after),
    CPython ends the thread inside that C++ destructor and the process aborts: SIGABRT, "terminate called
    without an active exception", and a finished job reported as failed (about 1 run in 10 of
    train_gpt.py saving its last checkpoint with 2 ranks on the 2-core machine). Sleeping releases the
    GIL while the interpreter is still whole, so a thread still holding a collective frees it now."""
    time.sleep(GLOO_EXIT_GRACE_S)
