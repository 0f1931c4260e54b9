"""An Accelerate loop with a DeepSpeedPlugin (ZeRO stages 2 and 3) on dslaunch through the `deepspeed`
compat package, launched as ``deepspeed --num_gpus 2 loop.py`` on CPU: the loss of every step and the
trained model's loss over the whole data set equal the same loop on Accelerate's plain CPU DDP, and
Accelerate counts both CPU workers (it would see one without the backend hand-over in
runtime.dist_api)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "accelerate_loop.py"
DEEPSPEED = Path(sys.executable).parent / "deepspeed"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_accelerate_deepspeed_plugin_stages_2_and_3_match_ddp(tmp_path: Path) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    procs = {
        stage: subprocess.Popen(
            [
                str(DEEPSPEED),
                "--num_gpus",
                "2",
                "--master_port",
                str(free_port()),
                str(SCRIPT),
                "--zero_stage",
                str(stage),
                "--out",
                f"stage{stage}.json",
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for stage in (0, 2, 3)
    }
    runs = {}
    for stage, proc in procs.items():
        output, _ = proc.communicate(timeout=280)
        assert proc.returncode == 0, output[-4000:]
        runs[stage] = json.loads((tmp_path / f"stage{stage}.json").read_text())

    ddp = runs[0]
    assert ddp["type"] == "DistributedType.MULTI_CPU" and ddp["num_processes"] == 2
    assert len(ddp["losses"]) == 5
    assert ddp["final_loss"] < ddp["initial_loss"] - 0.5  # it trained
    for stage in (2, 3):
        run = runs[stage]
        assert run["type"] == "DistributedType.DEEPSPEED" and run["num_processes"] == 2, run
        assert len(run["losses"]) == len(ddp["losses"])
        for got, want in zip(run["losses"], ddp["losses"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (stage, run["losses"], ddp["losses"])
        assert abs(run["final_loss"] - ddp["final_loss"]) <= 1e-5 * ddp["final_loss"], (stage, run, ddp)
