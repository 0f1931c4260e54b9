"""Launcher test worker: every rank joins a gloo group (``import runtime``: its exception hook writes the
error file); FAIL_RANK raises ValueError after the first all-reduce, the others go on all-reducing, so
they fail only because they lost their peer (gloo's "Connection closed by peer" or a broken pipe).
With LATE=1 the failing rank first closes its connections and raises 1.5 s later (ignoring SIGTERM), so
its peers' failures reach the launcher before its own (as a failure on another node can). With FINISH=1
the rank does not raise: it returns (exit code 0) while its peers still all-reduce with it."""

import os
import signal
import time

import torch
import torch.distributed as dist

import runtime  # noqa: F401  (the exception hook: error files)
from runtime.distributed import init_distributed

init_distributed()
rank = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
print(f"rank {rank} is up", flush=True)
if str(rank) == os.environ["FAIL_RANK"]:
    if os.environ.get("FINISH") == "1":
        raise SystemExit(0)
    if os.environ.get("LATE") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the stop its peers' failures start must wait
        dist.destroy_process_group()
        time.sleep(1.5)
    raise ValueError(f"shard {rank} of data/train.bin is corrupt")
while True:
    dist.all_reduce(t)
