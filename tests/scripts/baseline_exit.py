"""How the plain-PyTorch baseline arms of the client scripts end: every rank waits for the others, then the
process leaves without interpreter shutdown.

The baselines run torch's own gloo process group (Trainer's, Accelerate's or Lightning's DDP), which
dslaunch's runtime does not guard. Such a process aborts in interpreter shutdown when a gloo worker
thread frees its last collective after the interpreter has begun to finalize (SIGABRT, "terminate called
without an active exception"): 10 exits in 30 for a two-rank script ending in a barrier on the 2-core
host, and once per few full suites for the Hugging Face Trainer's DDP arm. The baseline's result is
written by then, so its exit code must not depend on that race. The engine's arms exit normally: that
clean exit is part of what the tests check (runtime.distributed guards it).
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def leave_baseline() -> None:
    """Barrier (a rank must not leave while another still runs a collective with it), flush, exit 0."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
