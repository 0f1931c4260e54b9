"""An Accelerate loop with a DeepSpeedPlugin (ZeRO stages 2 and 3, and 2 with the optimizer offloaded, where
Accelerate swaps the torch AdamW for deepspeed.ops.adam.DeepSpeedCPUAdam) on dslaunch through the `deepspeed`
compat package, launched as ``deepspeed --num_gpus 2 loop.py`` on CPU: the loss of every step and the
trained model's loss over the whole data set equal the same loop on Accelerate's plain CPU DDP, and
Accelerate counts both CPU workers (it would see one without the backend hand-over in
runtime.deepspeed_api.collectives)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.dist import free_port
from tests.support.paths import REPO

REPO = REPO
SCRIPT = REPO / "tests" / "scripts" / "accelerate_loop.py"
DEEPSPEED = Path(sys.executable).parent / "deepspeed"


def test_accelerate_deepspeed_plugin_stages_2_and_3_match_ddp(tmp_path: Path) -> None:
    # CPU workers: Trainer and Accelerate choose their device themselves, so a GPU host hides its GPUs
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    variants = {"ddp": ["--zero_stage", "0"], "z2": ["--zero_stage", "2"], "z3": ["--zero_stage", "3"],
                "z2-offload": ["--zero_stage", "2", "--offload"]}  # fmt: skip
    procs = {}
    for name, flags in variants.items():
        command = [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(free_port()), str(SCRIPT), *flags]
        procs[name] = subprocess.Popen(
            [*command, "--out", f"{name}.json"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    runs = {}
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=280)
        assert proc.returncode == 0, output[-4000:]
        runs[name] = json.loads((tmp_path / f"{name}.json").read_text())

    ddp = runs["ddp"]
    assert ddp["type"] == "DistributedType.MULTI_CPU" and ddp["num_processes"] == 2
    assert len(ddp["losses"]) == 5
    assert ddp["final_loss"] < ddp["initial_loss"] - 0.5  # it trained
    for stage in ("z2", "z3", "z2-offload"):  # offload: Accelerate swaps in DeepSpeedCPUAdam
        run = runs[stage]
        assert run["type"] == "DistributedType.DEEPSPEED" and run["num_processes"] == 2, run
        assert len(run["losses"]) == len(ddp["losses"])
        for got, want in zip(run["losses"], ddp["losses"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (stage, run["losses"], ddp["losses"])
        assert abs(run["final_loss"] - ddp["final_loss"]) <= 1e-5 * ddp["final_loss"], (stage, run, ddp)
