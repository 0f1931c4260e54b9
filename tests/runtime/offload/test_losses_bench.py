"""scripts/bench/offload_losses.py on the CPU: every offload mode repeats the losses of the same engine
without offload, step for step, and "auto" reports the ratio it ran with (1 on a CPU device)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.paths import REPO

REPO = REPO


def test_offload_modes_repeat_the_losses_of_no_offload() -> None:
    cmd = [sys.executable, "scripts/bench/offload_losses.py", "--device", "cpu", "--size", "64:4:2"]
    cmd += ["--seq_len", "32", "--steps", "3", "--modes", "none,r0.5+ckpt,auto,r0.5+param"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["config"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert [rows[m]["ratio"] for m in ("none", "r0.5+ckpt", "auto", "r0.5+param")] == [None, 0.5, 1.0, 0.5]
    losses = rows["none"]["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0]  # the repeated batch is being learned
    summary = rows["summary"]
    assert summary["baseline"] == "none"
    assert [summary[f"{m}_max_abs_diff"] for m in ("r0.5+ckpt", "auto", "r0.5+param")] == [0.0, 0.0, 0.0]
