"""scripts/bench/long_context.py on the CPU: a tiny Llama-shaped model trains one length in its own process
with the tiled MLP, tiled loss and checkpointed layers, and the walk reports it as the longest."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from tests.support.paths import REPO

ROOT = REPO


def _walk(*args: str) -> list[dict]:
    """Run long_context.py on the CPU with a tiny Llama shape and `args`; its JSON lines."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "scripts" / "bench" / "long_context.py")
    command = [sys.executable, script, "--model", "64:128:2:4:2:100", "--device", "cpu", *args]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_one_length_trains_and_the_summary_names_it() -> None:
    tried, summary = _walk("--start", "96", "--max", "96", "--steps", "2")
    assert tried["ok"] and tried["seq_len"] == 96, tried
    assert (
        tried["setup"]["tiled_mlp"] and tried["setup"]["tiled_loss"] and tried["setup"]["cpu_checkpointing"]
    )
    assert len(tried["losses"]) == 2 and all(math.isfinite(loss) for loss in tried["losses"])
    assert tried["tokens_per_s"] > 0 and tried["mfu"] is None  # no known peak for a CPU
    assert summary["summary"] and summary["longest"] == 96 and "estimate" not in summary


def test_lean_norms_and_16_bit_states_on_the_device_run_as_asked() -> None:
    """The 8B's 500K configuration (issue 34 with issue 32's keys): lean norms, bf16 masters and moments,
    no offload. The lean norms' forward is HF's bit for bit, so the first loss equals the plain run's."""
    plain, _ = _walk("--start", "96", "--max", "96", "--steps", "2")
    lean, _ = _walk(
        *("--start", "96", "--max", "96", "--steps", "2", "--lean_norms", "--bf16_optimizer_states"),
        "--no_offload",
    )
    assert lean["ok"] and lean["setup"]["lean_norms"] and not lean["setup"]["offload_optimizer"]
    assert (lean["setup"]["master_dtype"], lean["setup"]["state_dtype"]) == ("bf16", "bf16")
    assert lean["losses"][0] == plain["losses"][0]


def test_the_time_limit_stops_the_walk_before_a_slow_length() -> None:
    """One step at 96 tokens gives the rate; 192 tokens would take longer than a microsecond: untried."""
    tried, summary = _walk(
        *("--start", "96", "--max", "4096", "--multiple", "32", "--steps", "1", "--time_limit", "1e-6")
    )
    assert tried["seq_len"] == 96 and tried["ok"] and tried["hw_tflops"] > 0  # the rate it predicts from
    assert len(tried["losses"]) == 1 and tried["step_s"] > 0  # --steps 1: the one step is the timed one
    assert summary["longest"] == 96 and summary["stopped_by"] == "time" and summary["would_try"] == 192


def test_a_failed_length_reports_the_exception_not_the_warning_after_it() -> None:
    from scripts.bench.long_context import error_line

    stderr = [
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.02 GiB.",
        "[rank0]:[W1206 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() was not called",
    ]
    assert error_line(stderr).startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert error_line(["Killed"]) == "Killed"  # nothing raised: the last line
