"""The compiled-throughput benchmark (scripts/bench/compiled.py) on the CPU: its --tiny smoke check runs the
Llama-shaped model (a transformers LlamaForCausalLM built from a config) in its own process, the compiled
plain loop first, and reports each configuration's spread over the repeats and its ratio to that loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.paths import REPO

ROOT = REPO


def test_tiny_llama_rows_carry_spread_and_ratio_to_the_compiled_plain_loop() -> None:
    """Also --regions_stages 3: stage 3's per-unit compile plan on one rank (each block and the head alone,
    the glue eager) trains the same seeded model and batch to the same first loss as the whole model
    compiled, and its row says it compiled more graphs, none broken. With --profile_update our rows say
    where the optimizer step's time went (the plain loop's has no such row), and they record the step's
    run size and guard stance."""
    script = str(ROOT / "scripts" / "bench" / "compiled.py")
    command = [sys.executable, script, "--tiny", "--models", "llama3b", "--stages", "3",
               "--regions_stages", "3", "--steps", "1", "--warmup", "1", "--repeats", "2",
               "--profile_update", "--run_elements", "1000", "--skip_guard_eval"]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"bench"')]
    start, torch_row, ours, regions = rows
    assert start["event"] == "start" and start["device"] == "cpu"
    assert [r["config"] for r in rows[1:]] == ["torch-compiled", "ours-compiled-zero3", "ours-regions-zero3"]
    assert torch_row["ratio_to_torch_compiled"] == 1.0
    assert ours["ratio_to_torch_compiled"] == round(ours["tokens_per_s"] / torch_row["tokens_per_s"], 4)
    for row in (torch_row, ours, regions):
        assert row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
        assert row["repeats"] == 2 and row["model"] == "llama3b" and row["graph_breaks"] == 0
    # the same seeded model and batch: bf16 weights (ours) against fp32 weights under bf16 autocast
    assert abs(ours["loss_first"] - torch_row["loss_first"]) < 0.01 * torch_row["loss_first"]
    # each region is a graph of its own (the tiny Llama's decoder layers, embedding, norm and head: 5 on
    # torch 2.13), where the whole model is one
    assert regions["loss_first"] == ours["loss_first"]
    assert regions["graphs_compiled"] > ours["graphs_compiled"] >= 1
    assert "update_profile" not in torch_row and "run_elements" not in torch_row
    assert ours["run_elements"] == 1000 and ours["skip_guard_eval"] is True  # the step's A/B, recorded
    profile = ours["update_profile"]
    assert profile["host_ms"] > 0 and profile["kernels_launched"] == 0  # the CPU: no CUDA kernels
    assert any(name.startswith("Optimizer.step#AdamW") for name, _ms, _n in profile["top_host"]), profile


def test_deepspeed_rows_never_measure_our_compat_package() -> None:
    """Device: CPU. --ds_stages asks for DeepSpeed's compiled engine beside ours; where `import deepspeed`
    finds dslaunch's compatibility package (as in this suite's environment), the row says so instead of
    timing our own engine under DeepSpeed's name, and the run still succeeds with the other rows."""
    script = str(ROOT / "scripts" / "bench" / "compiled.py")
    command = [sys.executable, script, "--tiny", "--models", "xl", "--stages", "0", "--ds_stages", "2",
               "--steps", "1", "--warmup", "1", "--repeats", "1"]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"bench"')]
    assert [row.get("config") for row in rows[1:]] == [
        "torch-compiled",
        "ours-compiled-zero0",
        "deepspeed-compiled-zero2",
    ]
    assert "tokens_per_s" in rows[2] and "tokens_per_s" not in rows[3]
    assert rows[3]["error"].startswith(
        "ImportError: the deepspeed importable here is dslaunch's compatibility package"
    )
