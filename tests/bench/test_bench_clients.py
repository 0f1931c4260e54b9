"""The clients benchmark (scripts/bench/clients.py) as a CPU smoke check: each configuration is launched the
way the GPU run launches it (Lightning's own launcher, the real `accelerate launch`), on a tiny GPT-2, and
reports what the GPU run is read for: tokens/s, the class that trained the model, the ratio of each
DeepSpeed configuration to its unsharded twin.

Lightning's DeepSpeed strategy runs here at world 1: Lightning clears every parameter's .grad
(`LightningModule.zero_grad()`) right after `deepspeed.initialize`, which the one-rank ZeRO stage takes as
"cleared" (runtime.zero.replicated) and trains on, with DDP's losses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.test_bench_hf import bench_lines, cpu_env, needs_hf
from tests.support.paths import REPO

ROOT = REPO
BENCH = ROOT / "scripts" / "bench" / "clients.py"


@needs_hf
def test_clients_bench_runs_lightning_and_accelerate_launch_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "clients.jsonl"
    configs = "lightning-ddp,lightning-ds3,accelerate,accelerate-ds3"
    command = [sys.executable, str(BENCH), "--device", "cpu", "--tiny", "--configs", configs, "--batch", "2",
               "--warmup", "1", "--steps", "2", "--timeout", "200", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(command, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    lines = bench_lines(proc.stdout)
    assert lines == [json.loads(line) for line in out.read_text().splitlines()]
    *records, summary = lines
    assert [r["config"] for r in records] == configs.split(",")
    by = {r["config"]: r for r in records}
    for record in records:
        assert record["tokens_per_s"] > 0 and record["model"] == "gpt2-tiny", record
        assert record["provenance"]["commit"]
    assert by["accelerate-ds3"]["distributed_type"] == "DistributedType.DEEPSPEED"
    assert by["accelerate-ds3"]["zero_stage"] == 3
    # our engine, under DeepSpeed's name
    assert by["accelerate-ds3"]["trained_by"] == "runtime.engine.engine.Engine"
    assert by["accelerate"]["distributed_type"] == "DistributedType.NO"
    assert by["lightning-ddp"]["strategy"] == "DDPStrategy"
    assert by["lightning-ds3"]["trained_by"] == "runtime.engine.engine.Engine"
    # the same model, batches and seed: ZeRO-3 through Lightning follows DDP's curve
    for key in ("first_loss", "last_loss"):
        assert by["lightning-ds3"][key] == pytest.approx(by["lightning-ddp"][key], abs=1e-4), key
    assert summary["event"] == "summary" and summary["failed"] == []
    assert summary["ratio_to_unsharded"]["accelerate-ds3"] > 0
    assert summary["ratio_to_unsharded"]["lightning-ds3"] > 0
