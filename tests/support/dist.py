"""Run a function on N ranks (gloo on CPU, or NCCL on GPUs) in fresh processes, for distributed tests.

`run_distributed(fn, world_size, *args)` starts one process per rank, gives each a fresh process group
(a FileStore in a new temp dir, so concurrent test runs never share a rendezvous; or, with
rendezvous="env", runtime.init_distributed() on a free TCP port, the path a launched job takes), calls
`fn(rank, world_size, *args)` and returns the per-rank results in rank order. Each rank's device is
explicit: by default it trains on the CPU over gloo (`DS_ACCELERATOR=cpu`), even on a machine with GPUs,
so the same tests pass there; a test marked `gpu` passes `device="cuda"`, and each rank then trains on
its GPU (`DS_ACCELERATOR=cuda`, cuda:LOCAL_RANK) over NCCL, as a launched job on GPUs does. The first
worker exception is re-raised in the test process as `WorkerFailed` with the rank and the worker's
traceback text; a worker that dies without a word, or a run past `timeout` seconds, also fails the test
and kills the rest.

Workers come from a forkserver that has already imported torch, so starting a world costs a fork, not a
torch import (about 5 s on the 2-core CI box). `fn` and its arguments must be picklable (module-level
functions of an importable module), and results should be small (numbers, small tensors); they are
pickled by value.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from launcher.machine import find_free_port

DEFAULT_TIMEOUT = 120.0
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}  # by the device the ranks train on
_CONTEXT: Any = None


class WorkerFailed(AssertionError):
    """A rank raised (or died, or hung) during a distributed test."""

    def __init__(self, rank: int | None, detail: str) -> None:
        self.rank = rank
        who = f"rank {rank}" if rank is not None else "workers"
        super().__init__(f"{who} failed:\n{detail}")


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        # torch._dynamo: every torch optimizer imports it on construction (seconds per rank otherwise)
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "runtime"])
        _CONTEXT = ctx
    return _CONTEXT


def free_port() -> int:
    """A TCP port free on this machine now, from below the kernel's ephemeral range (the launcher's rule:
    port 0's answer raced gloo's outgoing connections under a parallel suite)."""
    return find_free_port()


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    store_path: str,
    port: int,
    rendezvous: str,
    device: str,
    results: Any,
) -> None:
    os.environ.update(
        DS_ACCELERATOR=device,
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # as dslaunch sets it for its workers
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if rendezvous == "file":
            if device == "cuda":
                from runtime.distributed import device_for

                torch.cuda.set_device(device_for(rank))  # what runtime.init_distributed does
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group(
                BACKENDS[device], store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=90)
            )
        else:
            import runtime

            runtime.init_distributed(timeout=timedelta(seconds=90))
        # plain pickle copies tensors into the message; torch's default sharing would hand the parent
        # file descriptors that vanish when this process exits
        results.put(("ok", rank, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report everything, including assertion failures and KeyboardInterrupt
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    rendezvous: str = "file",
    device: str = "cpu",
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks training on `device`: "cpu" (gloo) or
    "cuda" (NCCL, one GPU a rank; for tests marked `gpu`); return the results by rank."""
    if rendezvous not in ("file", "env"):
        raise ValueError(f"rendezvous must be 'file' or 'env', got {rendezvous!r}")
    if device not in BACKENDS:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    ctx = _context()
    tmp = tempfile.mkdtemp(prefix="dslaunch-dist-")
    results = ctx.Queue()
    port = free_port()  # rank 0 listens on it when rendezvous="env"
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, args, os.path.join(tmp, "store"), port, rendezvous, device, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        return _collect(procs, results, world_size, timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        results.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(procs: list[Any], results: Any, world_size: int, timeout: float) -> list[Any]:
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    silent_since: dict[int, float] = {}
    while len(done) < world_size:
        now = time.monotonic()
        if now > deadline:
            missing = sorted(set(range(world_size)) - set(done))
            raise WorkerFailed(None, f"ranks {missing} did not finish within {timeout:.0f} s (hang?)")
        try:
            kind, rank, payload = results.get(timeout=min(0.2, max(deadline - now, 0.01)))
        except queue_module.Empty:
            for rank, proc in enumerate(procs):
                if rank in done or proc.is_alive():
                    continue
                # Give its last message a moment to arrive through the pipe before calling it silent.
                first = silent_since.setdefault(rank, now)
                if now - first > 2.0:
                    raise WorkerFailed(
                        rank, f"process exited with code {proc.exitcode} without a result"
                    ) from None
            continue
        if kind == "error":
            raise WorkerFailed(rank, payload)
        done[rank] = pickle.loads(payload)
    return [done[rank] for rank in range(world_size)]
