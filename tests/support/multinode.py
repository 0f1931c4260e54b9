"""Running dslaunch across the sshd testbed's hosts from a test (tests/support/sshd_testbed.py): the worker
that reports its rank and environment, the job's arguments and environment (shared by the multi-node launcher
tests and the IPv6 tests)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support.dist import free_port
from tests.support.launching import DSLAUNCH, REPO
from tests.support.sshd_testbed import Testbed

REPORT_WORKER = """
import json, os, socket, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "DSL_TEST_VAR", "NCCL_DEBUG",
        "DSL_FROM_FILE", "PATH_LIKE"]
print("REPORT " + json.dumps({"sum": t.item(), "host": socket.gethostname(), "argv": sys.argv[1:],
                              "env": {k: os.environ.get(k) for k in keys}}), flush=True)
dist.destroy_process_group()
"""


def worker(tmp_path: Path, source: str, name: str = "worker.py") -> Path:
    path = tmp_path / name
    path.write_text(source)
    return path


def base_args(tb: Testbed, hostfile: Path | None = None, ssh_config: Path | None = None) -> list[str]:
    return ["--hostfile", str(hostfile or tb.hostfile), "--ssh_config", str(ssh_config or tb.ssh_config),
            "--master_port", str(free_port()), "--grace_period", "2"]  # fmt: skip


def job_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def run_dslaunch(args: list[str], env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run([*DSLAUNCH, *args], env=env or job_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
