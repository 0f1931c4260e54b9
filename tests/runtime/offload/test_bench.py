"""The offload bench script (scripts/bench/offload.py): its CPU smoke runs report the bound and every
configuration, and its summary holds each row to its own bound.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.support.paths import REPO


def _bench(*args: str, env: dict[str, str] | None = None) -> list[dict]:
    import json
    import os
    import subprocess
    import sys

    repo = REPO
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
    configs = "gpu,adam,pcie,devstep,ours,ours-dpu,ours-bf16grads,ours-z3-param"
    records = {r["config"]: r for r in _bench("--model", "tiny", *small, "--configs", configs, env=env)}
    for name in ("gpu", "adam", "pcie", "devstep", "ours", "ours-dpu", "ours-bf16grads", "ours-z3-param"):
        assert "error" not in records[name], records[name]
    # ZeRO-3 offload_param: the uploads' bytes a step (timed only on a GPU, by the upload stream's events)
    z3 = records["ours-z3-param"]
    assert z3["stage"] == 3 and z3["offload_param"] and z3["upload_serial"] is False
    assert z3["uploads_per_step"] > 0 and z3["upload_bytes_per_step"] > 0
    assert z3["upload_s_per_step"] is None and z3["loss_last"] < z3["loss_first"], z3
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

    # one size that trains and none above it: the search stops there and reports it. Two micro-batches a
    # step, one step per timing: the trial splits one more step into its first micro-batch and the last
    walk = ["--accumulation", "2", "--trial_steps", "1"]
    found = _bench("--find_max", "--sizes", "64:4:1", "--start_params", "0", *small, *walk)
    assert [r["trained"] for r in found if r["config"] == "trial"] == [True], found
    trial = found[-2]
    assert trial["accumulation"] == 2 and trial["micro_s"] > 0 and trial["boundary_s"] > 0, trial
    assert found[-1]["largest_trained"] == {"n_embd": 64, "n_head": 4, "n_layer": 1}
    assert found[-1]["host_bytes_per_param"] == pytest.approx(14.0, abs=0.1)


def _load_bench():
    import sys

    path = REPO / "scripts/bench/offload.py"
    spec = importlib.util.spec_from_file_location("offload_bench_under_test", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    return bench


def test_benchmark_summary_holds_each_row_to_its_own_bound_and_skips_what_is_missing() -> None:
    """A bound is only reported when every part of it was measured, and each engine row is compared with
    the bound of the gradients it moved (DeepSpeed's offload lands fp32 too)."""
    bench = _load_bench()

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
    assert full["accumulation"] == 1  # rows without the key: one micro-batch a step, the bounds as measured
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
    # ZeRO-3 offload_param: the upload stream's busy time against its bytes at the run's host-to-device rate
    z3 = {"step_s": 16.7, "upload_bytes_per_step": 334_700_000_000, "upload_s_per_step": 6.1}
    uploads = bench.summarize({**parts, "pcie": {**parts["pcie"], "up_gb_per_s": 55.0}, "ours-z3-param": z3})
    assert uploads["ours-z3-param_upload_over_link"] == pytest.approx(6.1 / (334.7 / 55.0), abs=1e-3)
    assert "ours-z3-param_upload_over_link" not in full  # no upload rows, or no PCIe rate: no ratio


def test_with_accumulation_each_engine_is_held_to_the_floor_of_its_own_step() -> None:
    """A step of A micro-batches: only the last can overlap the offloaded update, so every floor (the
    bounds, the host floor, the device floor) grows by (A-1)·T_gpu, at each engine row's own A."""
    bench = _load_bench()
    parts = {
        "gpu": {"step_s": 0.2},
        "adam": {"step_s": 0.5, "torch_fused_fp32_grads_s": 0.4, "torch_fused_fp32_with_copies_s": 0.45},
        "pcie": {"both_s": 0.06, "both_fp32_s": 0.12},
        "devstep": {"step_s": 0.38},
    }
    rows = {
        **parts,
        "ours": {"step_s": 2.0, "grad_landing": "float32", "accumulation": 4, "micro_s": 0.21},
        "ours-bf16grads": {"step_s": 1.5, "grad_landing": "bfloat16", "accumulation": 4},
        "ours-share0": {"step_s": 1.1, "grad_landing": "device", "accumulation": 4},
        "deepspeed": {"step_s": 0.8, "grad_landing": "float32", "accumulation": 1},
    }
    summary = bench.summarize(rows)
    assert summary["accumulation"] == 4 and summary["t_gpu_s"] == 0.2  # T_gpu stays one micro-batch's
    three = 3 * 0.2
    assert summary["bound_s"] == pytest.approx(0.5 + three) and summary["bound_by"] == "adam"
    assert summary["serial_s"] == pytest.approx(0.2 + 0.5 + 0.06 + three)
    assert summary["bound_fp32_s"] == pytest.approx(0.4 + three)
    assert summary["host_floor_fp32_s"] == pytest.approx(0.45 + three)
    assert summary["bound_device_s"] == pytest.approx(0.4 + three)  # max(0.2, 0.4, 3 x 0.12)
    assert summary["device_floor_s"] == pytest.approx(0.38 + three)
    assert summary["ours_over_bound"] == pytest.approx(2.0 / 1.0, abs=1e-3)
    assert summary["ours_over_host_floor"] == pytest.approx(2.0 / 1.05, abs=1e-3)
    assert summary["ours-bf16grads_over_bound"] == pytest.approx(1.5 / 1.1, abs=1e-3)
    assert summary["ours-share0_over_device_floor"] == pytest.approx(1.1 / 0.98, abs=1e-3)
    # the micro-batches before the last, timed apart, against plain PyTorch's (rows without them: none)
    assert summary["ours_micro_over_gpu"] == pytest.approx(1.05)
    assert "ours-share0_micro_over_gpu" not in summary
    # a row of one micro-batch a step in the same summary is held to the floor of one: the bounds alone
    assert summary["deepspeed_accumulation"] == 1 and "ours_accumulation" not in summary
    assert summary["deepspeed_over_bound"] == pytest.approx(0.8 / 0.4, abs=1e-3)
    assert summary["deepspeed_over_host_floor"] == pytest.approx(0.8 / 0.45, abs=1e-3)
    # rows written before they recorded their A take the run's (from --accumulation or the start line)
    bare = {name: {k: v for k, v in row.items() if k != "accumulation"} for name, row in rows.items()}
    again = bench.summarize(bare, accumulation=4)
    assert again["accumulation"] == 4 and again["ours_over_bound"] == summary["ours_over_bound"]
    assert again["deepspeed_over_bound"] == pytest.approx(0.8 / 1.0, abs=1e-3)
    # A=1 leaves every number as the bounds alone
    one = bench.summarize(bare)
    assert (one["bound_s"], one["device_floor_s"], one["ours_over_bound"]) == (0.5, 0.38, 5.0)


def test_mfu_is_against_the_devices_dense_bf16_peak() -> None:
    from scripts.bench.common import mfu, peak_bf16_flops

    assert peak_bf16_flops("NVIDIA H200") == 989e12 and peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert mfu(303e12, "NVIDIA H200") == pytest.approx(0.3064, abs=1e-4)  # 13.48B, accumulation 32
    assert mfu(1e12, None) is None and mfu(1e12, "AMD EPYC") is None  # the CPU: no peak, no MFU


def test_find_max_skips_what_the_estimator_rules_out_and_reports_the_estimates_error() -> None:
    """Every trial says what runtime.estimator.fit predicted; a size it puts beyond the host's memory is
    skipped, not tried; the summary compares the estimator's largest size with the walk's. The walk runs
    ZeRO-3 with the weights offloaded too, at a partial optimizer offload."""
    small = ["--micro_batch", "2", "--seq_len", "32", "--stage", "3", "--offload_param", "--ratio", "0.5"]
    huge = "12288:96:200"  # 362B parameters: several TiB of host memory at any ratio
    records = _bench("--find_max", "--sizes", f"64:4:1,{huge}", "--start_params", "0", *small)
    trials = [r for r in records if r["config"] == "trial"]
    assert [(r["n_layer"], r["trained"]) for r in trials] == [(1, True), (200, False)], trials
    first, second = trials
    assert (first["stage"], first["offload_param"], first["ratio"]) == (3, True, 0.5), first
    assert first["loss_last"] < first["loss_first"], first
    assert first["estimate"]["fits"] and first["estimate"]["ratio"] == 0.5, first["estimate"]
    assert first["accumulation"] == 1 and first["mfu"] is None  # no bf16 peak for a CPU
    assert "wall_s" not in second and second["skipped"].startswith("needs about "), second  # never started
    assert "runtime.estimator.fit" in second["skipped"]
    assert not second["estimate"]["fits"] and not second["estimate"]["host_fits"]
    assert second["estimate"]["host_need_gib"] > records[0]["host_available_gib"]
    summary = records[-1]
    assert summary["config"] == "find_max_summary" and summary["ratio"] == 0.5
    assert summary["largest_trained_params"] == summary["estimated_largest_params"] == first["params"]
    assert summary["estimated_largest"] == {"n_embd": 64, "n_head": 4, "n_layer": 1}
    assert summary["estimate_error"] == 0.0


def test_find_max_with_deepspeed_absent_reports_it_skipped() -> None:
    """Without DeepSpeed (here `import deepspeed` finds at most our compat package, which is not it) the
    walk stops at its first trial, says why, and does not fail the run (exit 0, as the step mode's
    deepspeed row); DeepSpeed has no "auto" ratio, so the record says what it would run with."""
    import subprocess
    import sys

    probe = "import deepspeed, sys; sys.exit(1 if hasattr(deepspeed, 'dslaunch_version') else 0)"
    if subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0:
        pytest.skip("DeepSpeed itself is installed here")
    bench = _load_bench()
    assert bench.parse_args(["--device", "cpu", "--find_max", "--ratio", "auto"]).ratio == "auto"
    records = _bench(
        "--find_max",
        "--engine",
        "deepspeed",
        "--ratio",
        "auto",
        "--sizes",
        "64:4:1,64:4:2",
        "--start_params",
        "0",
    )
    trials = [r for r in records if r["config"] == "trial"]
    assert len(trials) == 1 and trials[0]["skipped"].startswith("not importable: "), trials
    assert not trials[0]["trained"] and trials[0]["engine"] == "deepspeed"
    assert trials[0]["ratio"] == 1.0 and 'no "auto" ratio' in trials[0]["ratio_note"]
    summary = records[-1]
    assert summary["largest_trained_params"] is None and summary["skipped"] == trials[0]["skipped"]
    assert summary["tried"] == 1


def test_ratio_and_engine_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load_bench()
    for argv, message in (
        (["--ratio", "1.5"], "expected a number from 0 to 1, or auto, got '1.5'"),
        (["--engine", "deepspeed"], "--engine is for --find_max"),
        (["--find_max", "--offload_param"], "--offload_param needs --stage 3"),
        (["--gpt", "5120:40"], "size '5120:40' is not n_embd:n_head:n_layer"),
        (["--gpt", "64:4:2,64:4:3"], "--gpt takes one size"),
    ):
        with pytest.raises(SystemExit) as stop:
            bench.parse_args(["--device", "cpu", *argv])
        assert stop.value.code == 2 and message in capsys.readouterr().err
    # DeepSpeed runs a numeric ratio at ZeRO-3 only, and says so otherwise
    from scripts.bench.offload_work import deepspeed_ratio

    assert deepspeed_ratio({"ratio": 0.5, "stage": 3}) == (0.5, None)
    ratio, note = deepspeed_ratio({"ratio": 0.5, "stage": 2})
    assert ratio == 1.0 and note.startswith("DeepSpeed takes offload_optimizer.ratio only with ZeRO-3")


def test_bf16_states_go_into_every_engine_row_and_shrink_the_host_state() -> None:
    """--bf16_states (issue 32): the engine runs bf16.bf16_master_weights_and_grads and
    bf16.bf16_optimizer_states (stochastic rounding on, the default), each row says so, and the host holds
    6 bytes of state a parameter (bf16 master, bf16 moments) plus the 2-byte bf16 landing: 8, not 14."""
    small = ["--micro_batch", "2", "--seq_len", "32", "--warmup", "1", "--steps", "2"]
    records = {
        r["config"]: r for r in _bench("--model", "tiny", *small, "--configs", "ours", "--bf16_states")
    }
    ours = records["ours"]
    assert "error" not in ours, ours
    assert (ours["bf16_masters"], ours["bf16_states"], ours["stochastic_rounding"]) == (True, True, True)
    assert ours["grad_landing"] == "bfloat16" and ours["host_bytes_per_param"] == pytest.approx(8.0, abs=0.1)
    assert ours["loss_last"] < ours["loss_first"], ours
    assert ours["build_dtype"] == "bfloat16"  # no fp32 copy of a 20B model on the GPU before the engine
    assert records["summary"]["bf16_masters"] and records["summary"]["bf16_states"]
    assert records["start"]["args"]["bf16_masters"]  # implied by --bf16_states


def test_find_max_with_bf16_states_estimates_the_smaller_state() -> None:
    """A --find_max walk with --bf16_states: the trial trains with the 16-bit state (8 host bytes a
    parameter where the fp32 walk above has 14), its estimate is runtime.estimator.fit's with
    Workload(master_dtype="bf16", state_dtype="bf16"), which needs less host memory than the fp32 one, and
    the summary gives the largest size's flags, speed and losses."""
    from runtime.estimator.fit import Machine, Workload
    from scripts.bench.offload_max import Estimator
    from scripts.bench.offload_work import model_config

    small = ["--micro_batch", "2", "--seq_len", "32", "--trial_steps", "1"]
    records = _bench("--find_max", "--sizes", "64:4:1", "--start_params", "0", "--bf16_states", *small)
    trial, summary = records[-2], records[-1]
    assert trial["trained"] and trial["bf16_masters"] and trial["bf16_states"], trial
    assert trial["host_bytes_per_param"] == pytest.approx(8.0, abs=0.1), trial
    config = model_config({"n_embd": 64, "n_head": 4, "n_layer": 1, "seq_len": 32})
    need = {}
    for dtype in ("fp32", "bf16"):
        work = Workload(seq_len=32, micro_batch=2, activation_checkpointing=False)
        work = Workload(**{**work.__dict__, "master_dtype": dtype, "state_dtype": dtype})
        estimator = Estimator(Machine(80 * 2**30, 124 * 2**30), work, stage=2, offload_param=False, ratio=1.0)
        need[dtype] = estimator.fit(config)["host_need_bytes"]
    # ratio 1: the host's need does not depend on the machine, so the walk's estimate is the bf16 one
    assert trial["estimate"]["host_need_bytes"] == need["bf16"] < need["fp32"], (trial["estimate"], need)
    assert need["fp32"] - need["bf16"] == pytest.approx(6 * config.num_params(), rel=0.05)
    assert summary["bf16_masters"] and summary["bf16_states"] and summary["largest_trained_params"]
    for key in ("tokens_per_s", "loss_first", "loss_last", "setup_s", "wall_s"):
        assert summary[key] is not None and summary[key] == trial[key], key
    assert summary["mfu"] is None  # no bf16 peak for a CPU


def test_the_link_is_timed_on_a_sample_of_a_large_models_bytes_and_scaled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 17.6B model's copies (35 GB each way in bf16, twice that in fp32, on host and device) filled the
    H100 machine's host: past PCIE_SAMPLE_ELEMENTS the pcie row times a sample and scales its seconds to
    the whole model's bytes, so the bound still holds the whole step's copies."""
    import sys

    import torch

    sys.path.insert(0, str(REPO))
    from scripts.bench import offload_parts

    spec = {"n_layer": 2, "n_head": 4, "n_embd": 256, "seq_len": 64}
    n = offload_parts.model_config(spec).num_params()
    monkeypatch.setattr(offload_parts, "PCIE_SAMPLE_ELEMENTS", n // 4)
    row = offload_parts.work_pcie(spec, torch.device("cpu"))
    assert row["bytes_each_way"] == 2 * n and row["sampled_bytes_each_way"] == 2 * (n // 4)
    # the seconds are the whole model's: its bytes at the sample's rate
    assert row["down_s"] == pytest.approx(2 * n / (row["down_gb_per_s"] * 1e9), rel=0.1)
    assert row["up_s"] == pytest.approx(2 * n / (row["up_gb_per_s"] * 1e9), rel=0.1)
