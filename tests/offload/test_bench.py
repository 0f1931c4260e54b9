"""The offload bench script (scripts/bench/offload.py): its CPU smoke runs report the bound and every
configuration, and its summary holds each row to its own bound.
"""

from __future__ import annotations

import importlib.util

import pytest


def _bench(*args: str, env: dict[str, str] | None = None) -> list[dict]:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(repo / "scripts/bench/offload.py"), "--device", "cpu", *args]
    run_env = {**os.environ, **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=repo, env=run_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"bench": "offload"')]


def test_benchmark_reports_the_bound_and_every_configuration_on_cpu() -> None:
    small = ["--micro_batch", "2", "--seq_len", "32", "--warmup", "1", "--steps", "2", "--adam_steps", "3"]
    # on a CPU-only machine the engine lands gradients in their own dtype; fp32 is asked for here, so the
    # summary's fp32 bound is exercised too
    env = {"DSLAUNCH_OFFLOAD_GRAD_TRANSFER": "fp32"}
    configs = "gpu,adam,pcie,devstep,ours,ours-dpu,ours-bf16grads"
    records = {r["config"]: r for r in _bench("--model", "tiny", *small, "--configs", configs, env=env)}
    for name in ("gpu", "adam", "pcie", "devstep", "ours", "ours-dpu", "ours-bf16grads"):
        assert "error" not in records[name], records[name]
    # the device step alone runs on a CPU too (its "device" is host memory), through the engine's code
    assert records["devstep"]["step_s"] > 0 and records["devstep"]["params"] == records["adam"]["params"]
    summary = records["summary"]
    parts = [records["gpu"]["step_s"], records["adam"]["step_s"], records["pcie"]["both_s"]]
    assert summary["bound_s"] == pytest.approx(max(parts), abs=1e-4)
    bf16 = records["ours-bf16grads"]  # 12 B of fp32 state + 2 B of bf16 landing
    assert bf16["grad_landing"] == "bfloat16"
    assert bf16["host_bytes_per_param"] == pytest.approx(14.0, abs=0.1)
    assert bf16["loss_last"] < bf16["loss_first"], bf16
    want = bf16["step_s"] / max(parts)
    assert summary["ours-bf16grads_over_bound"] == pytest.approx(want, rel=1e-2, abs=2e-3)
    ours = records["ours"]  # fp32 landing: 4 B instead of 2, held to the fp32 bound
    assert ours["grad_landing"] == "float32"
    assert ours["host_bytes_per_param"] == pytest.approx(16.0, abs=0.1)
    parts32 = [parts[0], records["adam"]["torch_fused_fp32_grads_s"], records["pcie"]["both_fp32_s"]]
    assert summary["bound_fp32_s"] == pytest.approx(max(parts32), abs=1e-4)
    want = ours["step_s"] / max(parts32)
    assert summary["ours_over_bound"] == pytest.approx(want, rel=1e-2, abs=2e-3)
    dpu = records["ours-dpu"]  # and the delayed update's second landing buffer
    assert dpu["host_bytes_per_param"] == pytest.approx(20.0, abs=0.1)
    assert dpu["loss_last"] < dpu["loss_first"], dpu
    # the shared step (forced onto the CPU's "device"): 12 B of state, fp32 landing for the CPU's 40%
    env = {**env, "DSLAUNCH_OFFLOAD_UPDATE": "device"}
    shared, alone = _bench("--model", "tiny", *small, "--configs", "ours-share40,ours", env=env)[1:3]
    assert shared["config"] == "ours-share40" and "error" not in shared, shared
    # the device step alone lands no gradients at all: its row must not look for a landing buffer
    assert alone["config"] == "ours" and "error" not in alone, alone
    assert alone["grad_landing"] == "device" and alone["host_share"] == 0.0, alone
    assert shared["grad_landing"] == "device" and shared["host_share"] == 0.4
    assert 12.0 < shared["host_bytes_per_param"] < 14.5, shared  # 13.6 up to the spans' granularity
    assert shared["loss_last"] < shared["loss_first"], shared

    # one size that trains and none above it: the search stops there and reports it
    found = _bench("--find_max", "--sizes", "64:4:1", "--start_params", "0", *small)
    assert [r["trained"] for r in found if r["config"] == "trial"] == [True], found
    assert found[-1]["largest_trained"] == {"n_embd": 64, "n_head": 4, "n_layer": 1}
    assert found[-1]["host_bytes_per_param"] == pytest.approx(14.0, abs=0.1)


def test_benchmark_summary_holds_each_row_to_its_own_bound_and_skips_what_is_missing() -> None:
    """A bound is only reported when every part of it was measured, and each engine row is compared with
    the bound of the gradients it moved (DeepSpeed's offload lands fp32 too)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts/bench/offload.py"
    spec = importlib.util.spec_from_file_location("offload_bench_under_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    parts = {
        "gpu": {"step_s": 0.2},
        "adam": {"step_s": 0.5, "torch_fused_fp32_grads_s": 0.4, "torch_fused_fp32_with_copies_s": 0.45},
        "pcie": {"both_s": 0.06, "both_fp32_s": 0.12},
    }
    engines = {
        "ours": {"step_s": 0.6, "grad_landing": "float32"},
        "ours-bf16grads": {"step_s": 0.75, "grad_landing": "bfloat16"},
        "deepspeed": {"step_s": 1.0, "grad_landing": "float32"},
    }
    full = bench.summarize({**parts, **engines})
    assert (full["bound_s"], full["bound_fp32_s"], full["host_floor_fp32_s"]) == (0.5, 0.4, 0.45)
    assert full["ours_over_bound"] == 1.5 and full["ours_over_host_floor"] == pytest.approx(1.333, abs=1e-3)
    assert full["ours-bf16grads_over_bound"] == 1.5 and "ours-bf16grads_over_host_floor" not in full
    assert full["deepspeed_over_bound"] == 2.5  # held to the fp32 bound, like ours
    assert full["deepspeed_over_ours"] == pytest.approx(1.667, abs=1e-3)
    # the host step failed: no bound at all, but the engines still compare with each other
    failed = bench.summarize({**parts, "adam": {"error": "killed"}, **engines})
    assert not any(key.startswith(("bound", "host_floor")) or "_over_bound" in key for key in failed)
    assert failed["deepspeed_over_ours"] == pytest.approx(1.667, abs=1e-3)
    # no fp32 copies measured: the bf16 bound stands, the fp32 rows get no ratio to a bound
    partial = bench.summarize({**parts, "pcie": {"both_s": 0.06}, **engines})
    assert partial["bound_s"] == 0.5 and "bound_fp32_s" not in partial and "ours_over_bound" not in partial
    # the device step moves 12 bytes a parameter each way (three times the fp32 copies): its bound is
    # max(T_gpu, torch's fused CPU step, that PCIe time), and it has no host floor
    device = bench.summarize({**parts, "pcie": {"both_s": 0.06, "both_fp32_s": 0.15}, "ours": {
        "step_s": 0.54, "grad_landing": "device"}})  # fmt: skip
    assert device["bound_device_s"] == pytest.approx(0.45) and device["bound_device_by"] == "pcie"
    assert device["ours_over_bound"] == pytest.approx(1.2) and "ours_over_host_floor" not in device
    assert "device_floor_s" not in device  # no devstep row: no device floor
    # with the device step measured alone, its rows are also held to max(T_gpu, that time)
    floored = bench.summarize({**parts, "devstep": {"step_s": 0.4}, "ours": {
        "step_s": 0.5, "grad_landing": "device"}})  # fmt: skip
    assert floored["device_floor_s"] == 0.4 and floored["ours_over_device_floor"] == pytest.approx(1.25)
