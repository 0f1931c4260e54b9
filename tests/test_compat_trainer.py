"""Hugging Face Trainer on dslaunch through the `deepspeed` compat package, as its users run it:

    deepspeed --num_gpus 2 hf_trainer.py --deepspeed ds_config.json ...

on CPU (DS_ACCELERATOR=cpu, gloo, 2 workers). The config is Hugging Face's documented ZeRO-2 config with
CPU optimizer offload and its "auto" values, less its "scheduler" section: DeepSpeed's WarmupLR starts
its warmup one step after Transformers' own warmup schedules (DeepSpeed's semantics, which we keep), so
the comparison lets the Trainer build its scheduler into the engine, which is Transformers' documented
behaviour without that section. The loss of every step must equal the same script's run on plain DDP,
and resuming from the step-3 checkpoint must reproduce steps 4-6.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "hf_trainer.py"
ZERO2 = REPO / "tests" / "configs" / "deepspeed" / "hf_zero2.json"
DEEPSPEED = Path(sys.executable).parent / "deepspeed"  # the compat distribution's command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(free_port()), str(SCRIPT), *args]
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(proc: subprocess.Popen, losses: Path) -> dict[str, float]:
    output, _ = proc.communicate(timeout=280)
    assert proc.returncode == 0, output[-4000:]
    return json.loads(losses.read_text())


def test_trainer_zero2_offload_matches_ddp_and_resumes(tmp_path: Path) -> None:
    # The DeepSpeed run and the DDP reference at once (4 processes on 2 cores: mostly imports).
    ds = start(["--deepspeed", str(ZERO2), "--output_dir", "ds", "--losses_out", "ds.json",
                "--save_steps", "3"], tmp_path)  # fmt: skip
    ddp = start(["--output_dir", "ddp", "--losses_out", "ddp.json"], tmp_path)
    ds_losses = finish(ds, tmp_path / "ds.json")
    ddp_losses = finish(ddp, tmp_path / "ddp.json")

    assert list(ds_losses) == ["1", "2", "3", "4", "5", "6"]
    assert list(ddp_losses) == list(ds_losses)
    for step, loss in ddp_losses.items():
        assert abs(ds_losses[step] - loss) <= 1e-5 * abs(loss), (step, ds_losses, ddp_losses)
    assert ds_losses["6"] < ds_losses["1"] - 0.1  # it trained
    assert (tmp_path / "ds" / "checkpoint-3" / "global_step3").is_dir()  # the engine's own checkpoint

    checkpoint = str(tmp_path / "ds" / "checkpoint-3")
    resumed = start(["--deepspeed", str(ZERO2), "--output_dir", "resumed", "--losses_out", "resumed.json",
                     "--resume_from_checkpoint", checkpoint], tmp_path)  # fmt: skip
    resumed_losses = finish(resumed, tmp_path / "resumed.json")
    assert list(resumed_losses) == ["4", "5", "6"]
    for step, loss in resumed_losses.items():
        assert abs(ds_losses[step] - loss) <= 1e-6 * abs(loss), (step, resumed_losses, ds_losses)
