"""PEFT LoRA under ZeRO-3 (parameters and optimizer offloaded to the CPU: Hugging Face's documented ZeRO-3
config) through the Hugging Face Trainer on dslaunch's `deepspeed` compat package, 2 CPU workers over gloo:
the loss of every step equals plain DDP's, ``trainer.save_model`` writes the adapter (gathered from its
shards) equal to DDP's, and ``PeftModel.from_pretrained`` on a fresh base gives back the trained model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.dist import free_port
from tests.support.paths import REPO

REPO = REPO
SCRIPT = REPO / "tests" / "scripts" / "peft_lora.py"
ZERO3 = REPO / "tests" / "configs" / "deepspeed" / "hf_zero3.json"
DEEPSPEED = Path(sys.executable).parent / "deepspeed"  # the compat distribution's command


def test_peft_lora_under_zero3_trains_saves_and_reloads_like_ddp(tmp_path: Path) -> None:
    # CPU workers: Trainer and Accelerate choose their device themselves, so a GPU host hides its GPUs
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    runs = {"ddp": [], "z3": ["--deepspeed", str(ZERO3)]}
    procs = {}
    for name, flags in runs.items():
        command = [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(free_port()), str(SCRIPT), *flags,
                   "--output_dir", name, "--out", f"{name}.json"]  # fmt: skip
        procs[name] = subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    got = {}
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, output[-4000:]
        got[name] = json.loads((tmp_path / f"{name}.json").read_text())
    ddp, z3 = got["ddp"], got["z3"]
    assert list(ddp["losses"]) == ["1", "2", "3", "4", "5"]
    for step, loss in ddp["losses"].items():
        assert abs(z3["losses"][step] - loss) <= 1e-5 * loss, (z3["losses"], ddp["losses"])
    assert len(z3["adapter_tensors"]) == 4 and all("lora_" in name for name in z3["adapter_tensors"])
    assert z3["adapter_tensors"] == ddp["adapter_tensors"]
    assert abs(z3["adapter_abs_sum"] - ddp["adapter_abs_sum"]) <= 1e-5 * ddp["adapter_abs_sum"]
    for run in (ddp, z3):  # the adapter loaded onto a fresh base is the model that was trained
        assert abs(run["reloaded_loss"] - run["trained_loss"]) <= 1e-6 * run["trained_loss"], run
    assert abs(z3["reloaded_loss"] - ddp["reloaded_loss"]) <= 1e-5 * ddp["reloaded_loss"]
