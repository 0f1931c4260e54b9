"""Hugging Face Trainer on dslaunch through the `deepspeed` compat package, as its users run it:

    deepspeed --num_gpus 2 hf_trainer.py --deepspeed ds_config.json ...

on CPU (DS_ACCELERATOR=cpu, gloo, 2 workers). The configs are Hugging Face's documented ZeRO-2 (CPU
optimizer offload) and ZeRO-3 (CPU parameter and optimizer offload) configs with their "auto" values,
less their "scheduler" sections: DeepSpeed's WarmupLR starts
its warmup one step after Transformers' own warmup schedules (DeepSpeed's semantics, which we keep), so
the comparison lets the Trainer build its scheduler into the engine, which is Transformers' documented
behaviour without that section. The loss of every step must equal the same script's run on plain DDP,
resuming from the step-3 checkpoint must reproduce steps 4-6, and ZeRO-3's saved model must load back
equal to the trained weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.dist import free_port
from tests.support.paths import REPO

REPO = REPO
SCRIPT = REPO / "tests" / "scripts" / "hf_trainer.py"
ZERO2 = REPO / "tests" / "configs" / "deepspeed" / "hf_zero2.json"
ZERO3 = REPO / "tests" / "configs" / "deepspeed" / "hf_zero3.json"
DEEPSPEED = Path(sys.executable).parent / "deepspeed"  # the compat distribution's command


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    # CPU workers: Trainer and Accelerate choose their device themselves, so a GPU host hides its GPUs
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    command = [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(free_port()), str(SCRIPT), *args]
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(proc: subprocess.Popen, result: Path) -> dict:
    output, _ = proc.communicate(timeout=280)
    assert proc.returncode == 0, output[-4000:]
    return json.loads(result.read_text())


def assert_same_losses(got: dict[str, float], want: dict[str, float], rel: float) -> None:
    assert list(got) == list(want)
    for step, loss in want.items():
        assert abs(got[step] - loss) <= rel * abs(loss), (step, got, want)


def test_trainer_zero2_and_zero3_offload_match_ddp(tmp_path: Path) -> None:
    """ZeRO-2 (optimizer offload) and ZeRO-3 (parameter + optimizer offload, the model loaded with
    from_pretrained inside zero.Init) against DDP; ZeRO-2 resumes from its step-3 checkpoint; ZeRO-3's
    consolidated model.safetensors loads back equal. Two waves of launches, each wave concurrent."""
    ds = start(["--deepspeed", str(ZERO2), "--output_dir", "ds", "--losses_out", "ds.json",
                "--save_steps", "3"], tmp_path)  # fmt: skip
    ddp = start(["--output_dir", "ddp", "--losses_out", "ddp.json", "--final_dir", "ddp/final"], tmp_path)
    ds_run = finish(ds, tmp_path / "ds.json")
    ddp_run = finish(ddp, tmp_path / "ddp.json")
    want = ddp_run["losses"]
    assert list(want) == ["1", "2", "3", "4", "5", "6"]
    assert want["6"] < want["1"] - 0.1  # it trained
    assert_same_losses(ds_run["losses"], want, rel=1e-5)
    assert (tmp_path / "ds" / "checkpoint-3" / "global_step3").is_dir()  # the engine's own checkpoint

    checkpoint = str(tmp_path / "ds" / "checkpoint-3")
    resumed = start(["--deepspeed", str(ZERO2), "--output_dir", "resumed", "--losses_out", "resumed.json",
                     "--resume_from_checkpoint", checkpoint], tmp_path)  # fmt: skip
    z3 = start(["--deepspeed", str(ZERO3), "--output_dir", "z3", "--losses_out", "z3.json",
                "--from_pretrained", "--final_dir", "z3/final"], tmp_path)  # fmt: skip
    resumed_run = finish(resumed, tmp_path / "resumed.json")
    z3_run = finish(z3, tmp_path / "z3.json")
    assert_same_losses(resumed_run["losses"], {k: ds_run["losses"][k] for k in ("4", "5", "6")}, rel=1e-6)
    assert_same_losses(z3_run["losses"], want, rel=1e-5)

    # ZeRO-3: the consolidated file from_pretrained reads back is the engine's weights, and those are
    # the DDP run's weights.
    assert z3_run["reload_tensors"] >= 28 and z3_run["reload_max_diff"] == 0.0
    from safetensors.torch import load_file

    z3_weights = load_file(tmp_path / "z3" / "final" / "model.safetensors")
    ddp_weights = load_file(tmp_path / "ddp" / "final" / "model.safetensors")
    assert set(z3_weights) == set(ddp_weights)
    for key, value in ddp_weights.items():
        assert (z3_weights[key] - value).abs().max().item() <= 1e-5, key
