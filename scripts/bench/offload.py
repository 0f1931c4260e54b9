"""Optimizer offload on one GPU: step time against the hardware lower bound, DeepSpeed, and the largest model.

Step mode (default): GPT-2 XL (runtime.models.gpt, 1.56B), micro batch 8 x 1024 tokens, bf16, ZeRO-2, world
size 1, AdamW (lr 1e-4, weight decay 0.01), no clipping unless --clip. Every measurement runs in its own
subprocess (an out-of-memory error or a crashed library cannot spoil the next one), in this order:

    gpu          forward + backward alone (bf16 weights, no optimizer)                   -> T_gpu
    adam         our host step alone on a shard of the model's size: fp32 master/m/v, bf16
                 gradient in, bf16 weights out, in the same chunks as the engine            -> T_adam
                 (plus torch.optim.AdamW(fused=True) on fp32 gradients, the fp32-landing step; on
                 a GPU also that step while one step's fp32 copies run: the host floor)
    pcie         pinned copies of the bytes a step moves: 2 B/param down (gradients) and
                 2 B/param up (weights), each alone and both at once                        -> T_pcie
                 (and 4 B/param both ways at once, what fp32 landing moves: both_fp32_s)
    devstep      the device step alone (runtime/offload/step/device_step.py, no model): the fp32 master
                 and moments through the staging slots and back, updated from a device gradient;
                 with T_gpu, the device floor the device step's rows are also held to
    ours         runtime.initialize with offload_optimizer {device: cpu, pin_memory: true}; without
                 clipping the update runs during backward (the streamed step). On a GPU the GPU runs
                 it over state streamed from host memory (runtime/offload/step/device_step.py; its row says
                 grad_landing "device" and is held to a bound whose PCIe time is 12 B/param each way)
    ours-host    "ours" with DSLAUNCH_OFFLOAD_UPDATE=host: the CPU runs the Adam step on gradients that
                 land as the engine chooses (fp32 when host memory allows: runtime/offload/io/landing.py)
    ours-shareNN "ours" with DSLAUNCH_OFFLOAD_HOST_SHARE=0.NN: the CPU updates NN% of the elements from
                 landed gradients while the GPU streams the rest (ours-share0: the GPU all of it)
    ours-clip    the same with gradient_clipping 1.0: the update waits for the norm, after backward
    ours-unchecked  "ours" with bf16.check_grad_overflow false: no non-finite verdict, so one rank's update
                 streams during backward (DeepSpeed's bf16 default: a NaN step is applied)
    ours-waited  "ours" with the checked step waiting for its verdict (the internal setting speculate
                 false): "ours" streams its update during backward into a second copy of the state where
                 the GPU runs the step (runtime/offload/step/speculative.py; its row says "speculative"), and
                 the summary's checked_over_unchecked (ours over ours-unchecked; goal <= 1.05) and
                 ours-waited_over_ours show what that buys
    ours-dpu     the same with the delayed parameter update (runtime.offload.enable_delayed_update)
    ours-bf16grads   "ours-host" with DSLAUNCH_OFFLOAD_GRAD_TRANSFER=native: gradients land as bf16 and
                 the host step is ours (the adam row), 14 host bytes a parameter instead of 16
    ours-z3-param  ZeRO-3 with offload_param {device: cpu} too: weight shards in host memory, uploaded
                 ahead of use on their own stream (runtime/zero/stage3_upload.py); its row gives the
                 uploads' bytes and the upload stream's busy time a step (upload_bytes_per_step,
                 upload_s_per_step, upload_gb_per_s: hold them to the pcie row's bandwidth)
    ours-z3-param-serial  the same with the uploads queued on the compute stream (the path before)
    ours-device  the same engine without offload (for the offload/no-offload ratio)
    deepspeed    deepspeed.initialize with the same config (DeepSpeedCPUAdam), when importable (our compat/
                 package of DeepSpeed's names does not count); a ratio only at ZeRO-3 (deepspeed_ratio)

The summary line gives the lower bound max(T_gpu, T_adam, T_pcie) measured in this run, the serial sum
T_gpu + T_adam + T_pcie, and each engine's step time over both. An engine whose gradients landed as fp32
(its row's grad_landing) is held to the fp32 bound instead: T_adam is then torch's fused fp32 step
(the adam row's torch_fused_fp32_grads_s) and T_pcie the fp32 copies (the pcie row's both_fp32_s), and
also to host_floor_fp32_s, max(T_gpu, that step with the copies running beside it): the copies and the
step share the host's memory bandwidth, which the max() of the bound assumes away.
With --accumulation A a step is A micro-batches and the parts are one micro-batch's (T_gpu the mean of
a plain loop that accumulates A micro-batches into its gradients, as a trainer's does): only the last can
overlap the offloaded update, so each engine row (it records its `accumulation`) is held to
(A-1)·T_gpu plus each bound and floor, and the summary's bounds and floors are at the run's A (its
`accumulation`). Every engine row also gives tokens_per_s and mfu: the model's FLOPs a second over the
device's dense bf16 peak (common.peak_bf16_flops; null on a CPU).
Timing: --warmup steps, then --steps steps back to back between two device synchronizations: step_s is
their mean, a training loop's steady state (the gpu row and every engine alike), where copies still
running after one step overlap the next one's forward. Then the same number of steps each between
synchronizations (step_synced_s, their median, and step_synced_min_s): those drain every stream at
each step. The measurements of parts (adam, pcie, devstep) are medians of synchronized runs. "ours"
also reports a phase split from extra steps with a synchronization after forward, backward and step.
With A > 1 every engine row times one more step in two parts: micro_s, the mean of its first A-1
micro-batches (the summary's <name>_micro_over_gpu holds it to T_gpu), and boundary_s, the last with the
update.

--find_max (offload_max.py): the largest of --sizes (n_embd:n_head:n_layer) that trains --trial_steps
steps (3) with optimizer offload at --ratio (a number, or "auto": the engine picks the host's share),
with --stage, --offload_param, --accumulation, --activation_checkpointing and --engine (ours, or
deepspeed; --trial_dpu AFTER: ours with the delayed parameter update, so the host step overlaps the next
step's micro-batches); every try
carries what runtime.estimator.fit predicts for it, a size it puts beyond the host's memory is skipped,
not tried, and the summary compares the estimator's largest size with the largest that trained.

Issue 32's 16-bit state: --bf16_masters puts bf16.bf16_master_weights_and_grads (2-byte masters, no fp32
gradient copy) and --bf16_states also bf16.bf16_optimizer_states (bf16 moments; implies the masters) into
the config of every engine row (ours*, deepspeed) and every --find_max trial, and into the walk's estimate.
Each engine row records bf16_masters, bf16_states and stochastic_rounding as the engine resolved them (a
DeepSpeed row: what it was asked and what its optimizer reports, ds_*); the summary records the flags. The
parts of the bound (gpu, adam, pcie, devstep) do not change with them: adam still times fp32 state.

Output: JSON lines on stdout, each starting with {"bench": "offload" and stamped with the commit, date,
machine and command (common.py); a table on stderr. --out FILE appends them to FILE too, a bare --out to
results/<yyyymmdd>_<hw>_offload.jsonl (offload-find-max with --find_max). A run split over several
commands (--configs ... --out FILE each) is summarized with --summarize FILE. Exit code 1 when a
configuration of ours failed, or when --find_max trained no size (an engine that is not importable is
skipped, not failed). The measurements are in offload_work.py and offload_parts.py. CPU smoke check
(tiny model, the same code paths, copies synchronous):

    python scripts/bench/offload.py --device cpu --model tiny --micro_batch 2 --seq_len 64 --steps 2
    python scripts/bench/offload.py --device cpu --find_max --sizes 64:4:2,128:4:2 --start_params 0 \
        --seq_len 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from runtime.distributed import accelerator  # noqa: E402
from runtime.estimator.fit_cli import parse_ratio  # noqa: E402
from runtime.models import MODEL_SIZES  # noqa: E402
from scripts.bench import memory_peak  # noqa: E402
from scripts.bench.common import (  # noqa: E402
    Column,
    add_out_argument,
    emit,
    environment,
    init_single_process_group,
    out_file,
    print_table,
    run_isolated,
)
from scripts.bench.offload_bound import ENGINES, SHARE_CONFIG, engines, share_of, summarize  # noqa: E402
from scripts.bench.offload_max import find_max  # noqa: E402
from scripts.bench.offload_parts import work_adam, work_devstep, work_pcie  # noqa: E402
from scripts.bench.offload_work import LR, model_config, work_deepspeed, work_gpu, work_ours  # noqa: E402

CONFIGS = ("gpu", "adam", "pcie", "devstep", *ENGINES)
# n_embd:n_head:n_layer; 12·d² + 13·d per layer plus (50304 + 1024)·d of embeddings
DEFAULT_SIZES = (
    "4096:32:32,4096:32:36,5120:40:24,4096:32:40,5120:40:26,4096:32:44,5120:40:28,4096:32:48,5120:40:32"
)
MARK = '{"bench": "offload"'


# -- the configurations (each in its own process) ---------------------------------------------------------
def work_trial(spec: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """--find_max: does this size train, with the engine --engine names?"""
    if spec.get("engine") == "deepspeed":
        return work_deepspeed(spec, device)
    return work_ours(spec, device, phases=False, dpu=spec.get("trial_dpu"))


WORKERS = {
    "gpu": work_gpu,
    "adam": work_adam,
    "pcie": work_pcie,
    "devstep": work_devstep,
    "ours": work_ours,
    "ours-clip": lambda spec, device: work_ours({**spec, "clip": 1.0}, device),
    "ours-unchecked": lambda spec, device: work_ours({**spec, "unchecked": True}, device),
    "ours-waited": lambda spec, device: work_ours({**spec, "speculate": False}, device),
    "ours-host": work_ours,  # OVERRIDES below
    "ours-bf16grads": work_ours,
    "ours-dpu": lambda spec, device: work_ours(spec, device, dpu=spec["dpu_after"]),
    "ours-z3-param": lambda spec, device: work_ours({**spec, "stage": 3, "offload_param": True}, device),
    "ours-z3-param-serial": lambda spec, device: work_ours(
        {**spec, "stage": 3, "offload_param": True, "serial_uploads": True}, device
    ),
    "ours-device": lambda spec, device: work_ours(spec, device, offload=False),
    "deepspeed": work_deepspeed,
    "trial": work_trial,
}
# Benchmark overrides (runtime/config/offload.py), set in the configuration's process only; they beat a
# value the caller's environment holds, so a row means the same whatever the run inherits
OVERRIDES: dict[str, dict[str, str]] = {
    "ours-host": {"DSLAUNCH_OFFLOAD_UPDATE": "host"},
    "ours-bf16grads": {"DSLAUNCH_OFFLOAD_UPDATE": "host", "DSLAUNCH_OFFLOAD_GRAD_TRANSFER": "native"},
}


def worker_main(name: str, spec: dict[str, Any]) -> int:
    """One configuration, in this process: its result (or why not) as the last JSON line."""
    device = torch.device(spec["device"])
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    # our engine picks its device from DS_ACCELERATOR and LOCAL_RANK, not from --device: make them agree
    os.environ["DS_ACCELERATOR"] = device.type
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    os.environ.update(OVERRIDES.get(name, {}))
    share = share_of(name)
    if share is not None:
        os.environ["DSLAUNCH_OFFLOAD_HOST_SHARE"] = str(share)
    record: dict[str, Any] = {"bench": "offload", "config": name}
    tracing = bool(spec.get("memory_trace")) and device.type == "cuda"
    if tracing:  # before anything is allocated: every block alive at the peak is then in the trace
        memory_peak.start_trace()
    try:
        if name in (*ENGINES, "trial") or share is not None:
            init_single_process_group(device)
        record.update(WORKERS.get(name, work_ours)(spec, device))
    except ImportError as exc:
        record["skipped"] = f"not importable: {exc}"
    except Exception as exc:  # reported as a JSON line; the parent goes on with the next configuration
        text = f"{type(exc).__name__}: {exc}"
        record["error"] = text[:2000]
        record["oom"] = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in text.lower()
    if tracing:
        # after an out-of-memory error the peak is the moment before the allocation that failed: what the
        # estimate missed is among these sites
        record["memory_trace"] = memory_peak.peak_breakdown(memory_peak.device_trace(device))
    print(json.dumps(record), flush=True)
    return 0


# -- the parent -------------------------------------------------------------------------------------------
def run_worker(name: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one configuration in a fresh interpreter; its last JSON line is the result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--spec", json.dumps(spec)]
    done = run_isolated(cmd, timeout, cwd=REPO)
    if done.timed_out:
        return {"bench": "offload", "config": name, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if lines:
        record = json.loads(lines[-1])
    else:
        # killed without a word: the kernel's OOM killer sends SIGKILL (-9) when the host runs out
        tail = done.stderr.strip().splitlines()[-5:]
        why = "killed (host out of memory?)" if done.returncode == -9 else f"exit code {done.returncode}"
        record = {"bench": "offload", "config": name, "error": f"{why}: {' | '.join(tail)}"[:2000]}
        record["oom"] = done.returncode == -9
    record["wall_s"] = round(done.wall_s, 1)
    return record


TABLE = (
    Column("config", "config", width=14),
    Column("step s", lambda r: r.get("step_s", r.get("both_s")), ".4f", 9),
    Column("tokens/s", "tokens_per_s", ",.0f", 10),
    Column("MFU", "mfu", ".1%", 6),
)


def step_mode(args: argparse.Namespace, spec: dict[str, Any]) -> int:
    rows: dict[str, dict[str, Any]] = {}
    for name in args.configs:
        record = run_worker(name, spec, args.timeout)
        record.update(model=args.model, params=model_config(spec).num_params())
        emit(record, args.out)
        rows[name] = record
    summary = summarize(rows, args.accumulation)
    summary.update(bf16_masters=spec["bf16_masters"], bf16_states=spec["bf16_states"])
    emit(summary, args.out)
    print_table(list(rows.values()), TABLE)
    print(json.dumps(summary, indent=1), file=sys.stderr)
    ours_failed = any("error" in rows.get(n, {}) for n in engines(rows) if n != "deepspeed")
    return 1 if ours_failed else 0


def parse_sizes(text: str) -> list[dict[str, int]]:
    sizes = []
    for part in text.split(","):
        try:
            d, h, layers = (int(v) for v in part.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"size {part!r} is not n_embd:n_head:n_layer") from None
        sizes.append({"n_embd": d, "n_head": h, "n_layer": layers})
    return sizes


def parse_gpt(text: str) -> dict[str, int]:
    """--gpt: one n_embd:n_head:n_layer size for the step mode."""
    sizes = parse_sizes(text)
    if len(sizes) != 1:
        raise argparse.ArgumentTypeError(f"--gpt takes one size, got {text!r}")
    return sizes[0]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="xl", choices=sorted(MODEL_SIZES))
    parser.add_argument(
        "--gpt", type=parse_gpt, help="step mode: a GPT of n_embd:n_head:n_layer instead of --model"
    )
    parser.add_argument("--micro_batch", type=int, help="default 8 (1 with --find_max)")
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--clip", type=float, default=0.0, help="gradient_clipping (0 = off)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--adam_steps", type=int, default=5)
    parser.add_argument("--dpu_after", type=int, default=2, help="ours-dpu: synchronous steps before DPU")
    parser.add_argument(
        "--trial_dpu",
        type=int,
        metavar="AFTER",
        help="--find_max (ours): every trial with the delayed parameter update after AFTER steps, so the "
        "host step overlaps the next step's micro-batches (0: from the first); it costs a second landing "
        "buffer (2 host bytes a parameter) and a device staging copy of the shard, which the walk's estimate "
        "and host guard do not count",
    )
    parser.add_argument("--threads", type=int, help="torch threads in every worker (default: torch's)")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, from {', '.join(CONFIGS)}",
    )
    parser.add_argument("--find_max", action="store_true", help="largest GPT that trains with offload")
    parser.add_argument(
        "--ratio",
        type=parse_ratio,
        default=1.0,
        help='offload_optimizer.ratio: the host\'s share of the optimizer state, 0-1, or "auto" (the engine '
        "picks it from the device's memory)",
    )
    parser.add_argument(
        "--engine",
        choices=("ours", "deepspeed"),
        default="ours",
        help="--find_max: whose engine the trials run (DeepSpeed: at ratio 1 unless ZeRO-3 with a number)",
    )
    parser.add_argument(
        "--activation_checkpointing", action="store_true", help="recompute every block in backward"
    )
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=LR, help="AdamW's learning rate (ours and DeepSpeed)")
    parser.add_argument(
        "--offload_param", action="store_true", help="stage 3: the weights in host memory too (ours)"
    )
    parser.add_argument(
        "--bf16_masters",
        action="store_true",
        help="bf16.bf16_master_weights_and_grads in every engine's config (ours*, deepspeed, --find_max "
        "trials) and the walk's estimate: 2-byte masters",
    )
    parser.add_argument(
        "--bf16_states",
        action="store_true",
        help="bf16.bf16_optimizer_states too (implies --bf16_masters): bf16 Adam moments",
    )
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES))
    parser.add_argument("--start_params", type=float, default=8e9, help="--find_max: first size to try")
    parser.add_argument(
        "--trial_steps",
        type=int,
        default=3,
        help="--find_max: optimizer steps per timing of a trial (each trial times them twice)",
    )
    parser.add_argument(
        "--no_host_guard",
        action="store_true",
        help="--find_max: also try sizes whose estimated host memory exceeds what is available",
    )
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds per configuration")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="default: cuda where torch sees a GPU, unless DS_ACCELERATOR=cpu; every configuration, our "
        "engine included, runs there",
    )
    add_out_argument(parser, "offload")
    parser.add_argument(
        "--memory_trace",
        action="store_true",
        help="CUDA: record every allocation and report what was alive at the peak (or at an out-of-memory "
        "error), by site (scripts/bench/memory_peak.py); slows the step: not for timing",
    )
    parser.add_argument(
        "--summarize",
        type=Path,
        help="only print the summary of the latest record per configuration in this JSON-lines file "
        "(for a run split over several commands with the same --out)",
    )
    args = parser.parse_args(argv)
    if args.worker is not None:
        return args
    if args.device is None:
        args.device = accelerator()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS and share_of(n) is None]
    if unknown or not names:
        choices = ", ".join((*CONFIGS, f"{SHARE_CONFIG}0..{SHARE_CONFIG}100"))
        parser.error(f"unknown --configs {unknown or args.configs!r}; choose from {choices}")
    args.configs = names
    if args.engine != "ours" and not args.find_max:
        parser.error("--engine is for --find_max; the step mode runs DeepSpeed as --configs deepspeed")
    if args.offload_param and args.stage != 3:
        parser.error("--offload_param needs --stage 3 (ZeRO-3 partitions the weights it offloads)")
    args.bf16_masters = args.bf16_masters or args.bf16_states  # the states need the masters (config)
    args.out = out_file(args.out, "offload-find-max" if args.find_max else "offload")
    for name in ("seq_len", "steps", "adam_steps", "accumulation", "trial_steps"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive")
    if args.warmup < 0 or (args.micro_batch is not None and args.micro_batch <= 0):
        parser.error("--warmup must be >= 0 and --micro_batch positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker, json.loads(args.spec))
    if args.summarize is not None:
        rows, accumulation = {}, 1
        for line in args.summarize.read_text().splitlines():
            if line.startswith(MARK):
                record = json.loads(line)
                rows[record.get("config")] = record
                if record.get("config") == "start":  # rows written before they said their own
                    accumulation = record.get("args", {}).get("accumulation", 1)
        emit(summarize(rows, accumulation), None)
        return 0
    spec = {
        "device": args.device,
        "size": args.model,
        "micro_batch": args.micro_batch or 8,
        "seq_len": args.seq_len,
        "stage": args.stage,
        "clip": args.clip,
        "warmup": args.warmup,
        "steps": args.steps,
        "adam_steps": args.adam_steps,
        "dpu_after": args.dpu_after,
        "trial_dpu": args.trial_dpu,
        "threads": args.threads,
        "ratio": args.ratio,
        "lr": args.lr,
        "checkpointing": args.activation_checkpointing,
        "accumulation": args.accumulation,
        "offload_param": args.offload_param,
        "engine": args.engine,
        "bf16_masters": args.bf16_masters,
        "bf16_states": args.bf16_states,
        "memory_trace": args.memory_trace,
    }
    if args.gpt is not None:  # the step mode at a size of --find_max's kind (e.g. pcie beside ours-z3-param)
        spec.pop("size")
        spec.update(args.gpt)
        args.model = "{n_embd}:{n_head}:{n_layer}".format(**args.gpt)
    mode = "find_max" if args.find_max else "step"
    start = {"bench": "offload", "config": "start", "mode": mode, **environment(args.device)}
    start["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    emit(start, args.out)
    if args.find_max:
        spec.pop("size")
        return find_max(args, spec, run_worker)
    return step_mode(args, spec)


if __name__ == "__main__":
    sys.exit(main())
