"""The Hugging Face Trainer benchmark (scripts/bench/hf_trainer.py) and the compiled peers of
scripts/bench/train_throughput.py, as CPU smoke checks: every configuration runs the way the GPU run
will, on a tiny model, and reports what the GPU run's report is read for."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

ROOT = REPO
HF_BENCH = ROOT / "scripts" / "bench" / "hf_trainer.py"
THROUGHPUT = ROOT / "scripts" / "bench" / "train_throughput.py"

needs_hf = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
    reason="needs transformers and accelerate (bash scripts/test.sh installs them)",
)


def cpu_env() -> dict[str, str]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    return env


def bench_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"bench"')]


@needs_hf
def test_hf_trainer_bench_runs_every_configuration_on_cpu(tmp_path: Path) -> None:
    """plain, ds-zero2 and ds-zero3 (our compat `deepspeed` command) each report positive tokens/s for
    the same training, and the summary carries every ratio to plain. Trainer FSDP is skipped on CPU with
    its reason (Accelerate's CPU mode would train it under DDP)."""
    out = tmp_path / "hf.jsonl"
    command = [sys.executable, str(HF_BENCH), "--device", "cpu", "--tiny", "--batch", "2", "--warmup", "1",
               "--steps", "2", "--timeout", "200", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(command, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    lines = bench_lines(proc.stdout)
    assert lines == [json.loads(line) for line in out.read_text().splitlines()]
    *records, summary = lines
    assert [r["config"] for r in records] == ["plain", "ds-zero2", "ds-zero3", "fsdp"]
    *records, fsdp = records
    assert fsdp["skipped"].startswith("not run on CPU: the Trainer does not apply FSDP there")
    for r in records:
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and r["s_per_step"] > 0, r
        assert r["tokens_per_step"] == 2 * 64 and r["steps"] == 2 and r["world_size"] == 1
    by_config = {r["config"]: r for r in records}
    # launched as users launch them, and really trained by the engine that was asked for
    assert by_config["ds-zero2"]["command"].split()[1:3] == ["--num_gpus", "1"]
    assert by_config["ds-zero3"]["command"].split()[0].endswith("deepspeed")
    assert by_config["plain"]["command"].split()[1].endswith("hf_trainer.py")  # plain python at world 1
    for config in ("ds-zero2", "ds-zero3"):
        assert by_config[config]["wrapped_by"].startswith("runtime."), by_config[config]  # our engine
    # the same model on the same data from the same seed: the same mean training loss
    losses = [r["train_loss"] for r in records]
    assert max(losses) - min(losses) <= 1e-3, losses
    assert summary["event"] == "summary" and summary["failed"] == [] and summary["skipped"] == ["fsdp"]
    assert set(summary["ratio_to_plain"]) == {"plain", "ds-zero2", "ds-zero3"}
    assert summary["ratio_to_plain"]["plain"] == 1.0
    for config, ratio in summary["ratio_to_plain"].items():
        speed = by_config[config]["tokens_per_s"]
        assert ratio == round(speed / by_config["plain"]["tokens_per_s"], 4) and ratio > 0


def test_hf_trainer_bench_reports_timeouts_and_the_spent_budget_and_carries_on() -> None:
    def run(*flags: str) -> tuple[int, list[dict], dict]:
        command = [
            sys.executable,
            str(HF_BENCH),
            "--device",
            "cpu",
            "--tiny",
            "--configs",
            "plain,plain",
            *flags,
        ]
        proc = subprocess.run(command, env=cpu_env(), capture_output=True, text=True, timeout=120)
        *records, summary = bench_lines(proc.stdout)
        return proc.returncode, records, summary

    code, records, summary = run("--timeout", "0.5")
    assert code == 1 and len(records) == 2  # the first timeout did not stop the second configuration
    assert all(r["error"].startswith("timed out after 0.5 s") for r in records), records
    assert summary["failed"] == ["plain", "plain"] and summary["ratio_to_plain"] == {}

    code, (first, second), summary = run("--timeout", "5", "--budget", "0.5")
    assert code == 1 and first["error"].startswith("timed out after 0.5 s"), first
    assert second["error"] == "not run: the --budget of 0.5 s was spent by the configurations before"


def load_throughput_module() -> object:
    spec = importlib.util.spec_from_file_location("train_throughput", THROUGHPUT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up while the file executes
    spec.loader.exec_module(bench)
    return bench


def test_throughput_compiled_peers_follow_their_eager_peers_and_only_when_asked() -> None:
    bench = load_throughput_module()
    runs = bench.plan_runs(
        ["tiny"], ["ours-compiled", "fsdp2", "torch-compiled", "torch", "ours"], [0, 2], []
    )
    assert [r.label for r in runs] == [
        "torch", "ours-zero0", "ours-zero2", "torch-compiled", "ours-compiled-zero0", "ours-compiled-zero2",
        "fsdp2",
    ]  # fmt: skip
    assert bench.parse_args([]).peers == ["torch", "ours", "fsdp2", "deepspeed"]  # the default run unchanged


def test_throughput_compiled_engine_against_compiled_torch_on_cpu(tmp_path: Path) -> None:
    """torch.compile(model) and engine.compile() on the same workload (backend 'eager' here: dynamo
    traces both, no kernels are built, so the check takes seconds); the compiled rows carry MFU and
    ratio_to_torch_compiled, and both train to the same loss."""
    command = [sys.executable, str(THROUGHPUT), "--device", "cpu", "--models", "tiny", "--seq_len", "32",
               "--micro_batch", "2", "--warmup", "1", "--steps", "2", "--stages", "0",
               "--peers", "torch-compiled,ours-compiled", "--compile_backend", "eager"]  # fmt: skip
    proc = subprocess.run(command, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    start, torch_row, ours_row = bench_lines(proc.stdout)
    assert start["args"]["compile_backend"] == "eager"
    assert (torch_row["config"], ours_row["config"]) == ("torch-compiled", "ours-compiled-zero0")
    assert torch_row["ratio_to_torch_compiled"] == 1.0
    assert ours_row["ratio_to_torch_compiled"] == round(
        ours_row["tokens_per_s"] / torch_row["tokens_per_s"], 4
    )
    assert ours_row["ratio_to_torch"] is None  # no eager torch row in this run
    for row in (torch_row, ours_row):
        assert row["compile_backend"] == "eager" and row["tflops"] > 0 and "mfu" in row
    assert abs(ours_row["loss_last"] - torch_row["loss_last"]) <= 1e-3
