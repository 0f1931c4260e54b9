"""Running dslaunch from a test on this machine: the command, the test scripts, CPU workers (shared by the
local launcher tests and the fault tests)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.paths import REPO

REPO = REPO
SCRIPTS = REPO / "tests" / "scripts"
DSLAUNCH = [sys.executable, "-m", "launcher.cli"]
CPU = {"DS_ACCELERATOR": "cpu"}  # CPU workers, on a machine with GPUs too


def run_dslaunch(args, env=None, timeout=60.0, cwd=REPO) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **CPU, **(env or {})}
    return subprocess.run(
        [*DSLAUNCH, *args], env=full_env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
