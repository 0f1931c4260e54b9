"""TRL's SFTTrainer, DPOTrainer and GRPOTrainer under ZeRO-3 on dslaunch, as their users launch them:

    deepspeed --num_gpus 2 trl_trainers.py --deepspeed trl_zero3.json

on CPU (DS_ACCELERATOR=cpu, gloo, 2 workers; tests/scripts/trl_trainers.py runs the three trainers one
after the other in one process, a tiny GPT-2 built from a config, a tokenizer made there). The config is
TRL's ZeRO-3 setup (no optimizer section: the Trainer's AdamW; "auto" values); DPO runs twice, the
second time with `precompute_ref_log_probs` (a reference pass over the policy in an engine of its own
first). Every logged value of every step (losses; DPO's rewards, margins and accuracies; GRPO's rewards)
must equal the same script on plain DDP. GRPO samples its completions (temperature 1) from the trainer's
seeded generator inside TRL's `unwrap_model_for_generation` (everything gathered, hooks removed): with 2
ranks in fp32 the ZeRO-3 logits equal DDP's bit for bit, so the sampled tokens and rewards are the same
and the comparison is exact (1e-6 relative is allowed for the losses). DPO's reference model goes through
TRL's `prepare_deepspeed`: an engine without an optimizer whose weights stay sharded at rest.
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
SCRIPT = REPO / "tests" / "scripts" / "trl_trainers.py"
ZERO3 = REPO / "tests" / "configs" / "deepspeed" / "trl_zero3.json"
DEEPSPEED = Path(sys.executable).parent / "deepspeed"


def test_trl_dotted_zero3_keys_are_ignored_like_deepspeed() -> None:
    """TRL's prepare_deepspeed adds "zero_optimization.stage3_prefetch_bucket_size" etc. as top-level keys;
    DeepSpeed reads nested sections only and ignores them, so do we (with a note); a dotted typo of
    another kind is still an unknown key."""
    import pytest

    from runtime.config import ConfigError, load_config

    base = {"train_batch_size": 2, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 100}}
    trl = {**base, "zero_optimization.stage3_prefetch_bucket_size": 0.9 * 32 * 32,
           "zero_optimization.stage3_param_persistence_threshold": 320}  # fmt: skip
    config = load_config(trl, world_size=2)
    assert config.zero_optimization.stage3_prefetch_bucket_size == 100
    assert any(
        "zero_optimization.stage3_param_persistence_threshold" in n and "ignored" in n for n in config.notes
    )
    with pytest.raises(ConfigError, match=r"zero_optimisation\.stage"):
        load_config({**base, "zero_optimisation.stage": 3}, world_size=2)


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    # CPU workers: the trainers choose their device themselves, so a GPU host hides its GPUs
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    command = [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(free_port()), str(SCRIPT), *args]
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


def finish(proc: subprocess.Popen, result: Path) -> dict:
    output, _ = proc.communicate(timeout=280)
    assert proc.returncode == 0, output[-4000:]
    return json.loads(result.read_text())


def test_sft_dpo_grpo_under_zero3_match_ddp(tmp_path: Path) -> None:
    z3 = start(["--deepspeed", str(ZERO3), "--out", "z3.json", "--output_dir", "z3"], tmp_path)
    ddp = start(["--out", "ddp.json", "--output_dir", "ddp"], tmp_path)
    got, want = finish(z3, tmp_path / "z3.json"), finish(ddp, tmp_path / "ddp.json")

    for trainer in ("sft", "dpo", "dpo_precompute", "grpo"):
        assert got[trainer]["engine"] == "runtime.engine.engine.Engine", got[trainer]
        assert got[trainer]["stage"] == 3, got[trainer]
        assert "DistributedDataParallel" in want[trainer]["engine"], want[trainer]
        logs, reference = got[trainer]["logs"], want[trainer]["logs"]
        assert list(reference) == ["1", "2", "3"], reference
        assert {k: sorted(v) for k, v in logs.items()} == {k: sorted(v) for k, v in reference.items()}
        for step, values in reference.items():
            for key, value in values.items():
                assert abs(logs[step][key] - value) <= 1e-6 * max(abs(value), 1e-3), (trainer, step, key)
    assert want["sft"]["logs"]["3"]["loss"] < want["sft"]["logs"]["1"]["loss"] - 0.1  # it trained
    assert want["dpo"]["logs"]["3"]["rewards/margins"] > 0.1
    assert got["dpo"]["ref_optimizer"] == "None" and got["dpo"]["ref_released_fraction"] > 0.9
    assert got["dpo_precompute"]["precompute_masters_grads"] == [0, 0]  # an inference engine's weights only
    assert got["grpo"]["hook_removals"] >= 3  # one gathered generation per step at least
    assert len({round(v["reward"], 6) for v in want["grpo"]["logs"].values()}) > 1  # sampling differs
