"""The step-host benchmark (scripts/bench/step_host.py) on the CPU: its shrunk Llama makes the fused step
cut the same segments, so launch the same number of update kernels, at every shrink factor (so as the
full-size 3B Llama does), fewer than it has gradient tensors, and the row carries ours and torch's step
times from one process. Device: CPU (dynamo's eager backend: the smoke run; the measurement uses
inductor)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.paths import REPO


def test_the_shrunk_model_makes_the_same_segments_at_every_size() -> None:
    script = str(REPO / "scripts" / "bench" / "step_host.py")
    command = [sys.executable, script, "--backend", "eager", "--layers", "2", "--steps", "2",
               "--shrink", "32,16"]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    small, larger = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"bench"')]
    assert (small["shrink"], larger["shrink"]) == (32, 16)
    # 2 layers of 9 tensors, the embedding (the head is tied) and the final norm
    assert small["tensors"] == larger["tensors"] == 20
    assert larger["parameters"] > 3.9 * small["parameters"]  # every matrix 4x the elements
    assert small["segments"] == larger["segments"] < small["tensors"]  # runs join the small ones alike
    for key in ("ours_host_ms", "ours_step_ms", "torch_host_ms", "torch_step_ms"):
        assert small[key] > 0 and larger[key] > 0, (small, larger)
