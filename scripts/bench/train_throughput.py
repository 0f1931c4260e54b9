"""Training throughput on one device: our engine per ZeRO stage against plain PyTorch, FSDP2, DeepSpeed.

Every configuration trains the same GPT (runtime.models, GPT-2 sizes, vocab 50304, tied head) on the same
random batch, bf16, AdamW(lr=1e-4, weight_decay=0.01), no gradient clipping, in one process with a
process group of world size 1. Configurations, in this order for each model:

    torch      plain PyTorch: fp32 params, bf16 autocast, torch.optim.AdamW(fused=True)   (the baseline)
    ours       runtime.initialize with bf16 and zero_optimization.stage in --stages
    fsdp2      fully_shard on each block, then the root, MixedPrecisionPolicy(bf16 params, fp32 reduce)
    deepspeed  deepspeed.initialize with the same config as ours, for each of --ds_stages (when importable);
               all DeepSpeed runs come after every other configuration of every model

Two more peers, only when named in --peers, compare whole-model compilation (issue 20's target: the
compiled engine at >= 1.0x the compiled plain loop); their rows carry ratio_to_torch_compiled as well:

    torch-compiled  the torch loop on torch.compile(model)
    ours-compiled   ours, then engine.compile() (the module compiled in place under the engine's hooks)

Timing: --warmup steps, then --steps steps each bracketed by device synchronization; the median step time
gives tokens/s and TFLOP/s (6N + 12·L·d·T FLOPs per token, as in shared/research/perf_anchors.md §6.1).
Peak memory is torch.cuda.max_memory_allocated from model construction to the last step, less what was
still allocated before the configuration started (reported as mem_before_gib; it should be 0). Each
configuration gets a fresh model and frees everything before the next one. A configuration that fails
(out of memory included) is reported as a JSON line with "error" and the others still run.

Output: one JSON object per line on stdout, each with ratio_to_torch from the baseline measured in the
same run and stamped with the commit, date, machine and command (common.py), and a readable table on
stderr at the end. --out FILE appends the lines to FILE too, a bare --out to
results/<yyyymmdd>_<hw>_throughput.jsonl. Other libraries may print to stdout too: read the lines that
start with '{"bench"' or use --out. The peers' set-up is in throughput_peers.py.

    python scripts/bench/train_throughput.py                       # H200: medium + xl, about 5 minutes
    python scripts/bench/train_throughput.py --models medium --peers torch,ours --stages 2
    python scripts/bench/train_throughput.py --models xl --peers torch-compiled,ours-compiled --stages 2
    python scripts/bench/train_throughput.py --device cpu --models tiny --seq_len 64 --micro_batch 2 \\
        --warmup 1 --steps 2                                       # smoke check without a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from runtime.distributed import accelerator
from runtime.models import MODEL_SIZES, GPTConfig
from scripts.bench.common import (
    Column,
    add_out_argument,
    emit,
    environment,
    init_single_process_group,
    median_time,
    out_file,
    print_table,
    synchronize,
)
from scripts.bench.throughput_peers import ALL_PEERS, COMPILED_PEERS, PEERS, SETUPS, Batch, Workload

PEAK_BF16_TFLOPS = 989.0  # H100/H200 dense bf16 datasheet (1979 is the 2:4-sparse figure)
MEASURED_GEMM_TFLOPS = 790.0  # 8192^3 bf16 GEMM on one H200 (perf_anchors.md §6.1)
DEFAULT_MICRO_BATCH = {"medium": 16, "xl": 8}  # the batches of the perf_anchors.md §9 peer runs


@dataclass(frozen=True)
class Run:
    """One configuration to measure."""

    model: str
    peer: str
    stage: int | None = None

    @property
    def label(self) -> str:
        return self.peer if self.stage is None else f"{self.peer}-zero{self.stage}"


def plan_runs(models: list[str], peers: list[str], stages: list[int], ds_stages: list[int]) -> list[Run]:
    """Runs in measuring order: for each model the baseline first, then ours and FSDP2; DeepSpeed runs come
    after all the others, because it keeps global state that a later configuration could trip over."""
    runs: list[Run] = []
    for model in models:
        for peer in sorted(set(peers) - {"deepspeed"}, key=ALL_PEERS.index):
            if peer.startswith("ours"):
                runs += [Run(model, peer, s) for s in stages]
            else:
                runs.append(Run(model, peer))
    if "deepspeed" in peers:
        runs += [Run(model, "deepspeed", s) for model in models for s in ds_stages]
    return runs


def release_memory(device: torch.device, compiled: bool) -> None:
    gc.collect()
    if compiled:
        torch._dynamo.reset()  # drop compiled graphs that hold the previous model's tensors
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure(run: Run, work: Workload, batch: Batch, warmup: int, steps: int) -> dict[str, Any]:
    device = work.device
    allocated_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    setup_start = time.perf_counter()
    step = SETUPS[run.peer](work, batch, run.stage)
    synchronize(device)
    setup_s = time.perf_counter() - setup_start
    losses: list[torch.Tensor] = []
    median, times = median_time(lambda: losses.append(step()), device, warmup, steps)
    tflops = work.config.flops_per_token(work.seq_len) * work.tokens_per_step / median / 1e12
    result: dict[str, Any] = {
        "setup_s": round(setup_s, 2),
        "step_s_median": round(median, 5),
        "step_s_min": round(min(times), 5),
        "tokens_per_s": round(work.tokens_per_step / median, 1),
        "tflops": float(f"{tflops:.4g}"),
        "mfu": round(tflops / PEAK_BF16_TFLOPS, 4),
        "mfu_vs_gemm": round(tflops / MEASURED_GEMM_TFLOPS, 4),
        "loss_first": round(losses[0].item(), 4),
        "loss_last": round(losses[-1].item(), 4),
    }
    if device.type == "cuda":
        # This configuration's own peak: what an earlier configuration failed to free is subtracted (and
        # reported, since it should be zero).
        result["peak_mem_gib"] = round(
            (torch.cuda.max_memory_allocated(device) - allocated_before) / 2**30, 2
        )
        result["mem_before_gib"] = round(allocated_before / 2**30, 3)
    return result


def run_one(run: Run, work: Workload, batch: Batch, warmup: int, steps: int) -> dict[str, Any]:
    """Measure one configuration; any failure becomes {"error": ...} instead of stopping the benchmark."""
    compiled = work.compile or run.peer in COMPILED_PEERS
    release_memory(work.device, compiled)
    try:
        return measure(run, work, batch, warmup, steps)
    except ImportError as exc:
        return {"skipped": f"{run.peer} is not importable: {exc}"}
    except Exception as exc:  # one broken configuration must not hide the others' numbers
        out_of_memory = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc)
        return {"error": f"{type(exc).__name__}: {exc}"[:2000], "oom": out_of_memory}
    finally:
        release_memory(work.device, compiled)


def int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def device_arg(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device


def name_list(choices: tuple[str, ...] | list[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {unknown or text!r}; choose from {', '.join(choices)}")
        return names

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=name_list(list(MODEL_SIZES)), default=["medium", "xl"])
    parser.add_argument("--peers", type=name_list(ALL_PEERS), default=list(PEERS))
    parser.add_argument("--stages", type=int_list, default=[0, 1, 2, 3], help="ZeRO stages of ours")
    parser.add_argument("--ds_stages", type=int_list, default=[2, 3], help="ZeRO stages of DeepSpeed")
    parser.add_argument("--micro_batch", type=int, help="default: medium 16, xl 8, others 8")
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--compile", action="store_true", help="torch.compile each block, for every peer")
    parser.add_argument(
        "--compile_backend",
        default="inductor",
        help="torch.compile backend of the torch-compiled and ours-compiled peers ('eager' traces with "
        "dynamo but builds no kernels: the CPU smoke check)",
    )
    parser.add_argument(
        "--ds_torch_adam",
        action="store_true",
        help="DeepSpeed with torch AdamW instead of its JIT-built FusedAdam",
    )
    parser.add_argument(
        "--activation_checkpointing",
        action="store_true",
        help="recompute every transformer block in backward (runtime.activation_checkpointing), "
        "for every peer",
    )
    parser.add_argument(
        "--device",
        type=device_arg,
        default=None,
        help="cpu, cuda or cuda:N (default: cuda where torch sees a GPU, unless DS_ACCELERATOR=cpu); every "
        "configuration trains there, our engine included",
    )
    add_out_argument(parser, "throughput")
    args = parser.parse_args(argv)
    args.out = out_file(args.out, "throughput")
    if args.device is None:
        args.device = device_arg(accelerator())
    for name in ("seq_len", "steps"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive")
    if args.warmup < 0 or (args.micro_batch is not None and args.micro_batch <= 0):
        parser.error("--warmup must be >= 0 and --micro_batch positive")
    return args


def ratio(record: dict[str, Any], base_tokens_per_s: float | None) -> float | None:
    if base_tokens_per_s is None or "tokens_per_s" not in record:
        return None
    return round(record["tokens_per_s"] / base_tokens_per_s, 4)


TABLE = (
    Column("model", "model", width=8),
    Column("config", "config", width=20),
    Column("tokens/s", "tokens_per_s", ",.0f"),
    Column("x torch", "ratio_to_torch", ".3f", 8),
    Column("TFLOP/s", "tflops", ".1f", 8),
    Column("MFU", "mfu", ".1%", 6),
    Column("peak GiB", "peak_mem_gib", ".1f", 9),
)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device
    # our engine picks its device from DS_ACCELERATOR and LOCAL_RANK, not from --device: make them agree
    os.environ["DS_ACCELERATOR"] = device.type
    init_single_process_group(device)
    emit(
        {
            "bench": "train_throughput",
            "event": "start",
            **environment(str(device), deepspeed=True),
            "args": {
                k: (str(v) if isinstance(v, (Path, torch.device)) else v) for k, v in vars(args).items()
            },
        },
        args.out,
    )
    rows = []
    baseline: dict[tuple[str, str], float] = {}  # (model, torch or torch-compiled): tokens/s
    for run in plan_runs(args.models, args.peers, args.stages, args.ds_stages):
        base = GPTConfig.named(run.model)
        config = GPTConfig.named(run.model, max_seq_len=max(base.max_seq_len, args.seq_len))
        micro_batch = args.micro_batch or DEFAULT_MICRO_BATCH.get(run.model, 8)
        work = Workload(
            config,
            micro_batch,
            args.seq_len,
            device,
            args.compile,
            args.ds_torch_adam,
            args.activation_checkpointing,
            args.compile_backend,
        )
        # The same batch for every configuration of a model: random ids drawn once from a fixed seed.
        gen = torch.Generator().manual_seed(1234)
        tokens = torch.randint(0, config.vocab_size, (micro_batch, args.seq_len + 1), generator=gen)
        batch = (tokens[:, :-1].to(device), tokens[:, 1:].to(device))
        record: dict[str, Any] = {
            "bench": "train_throughput",
            "model": run.model,
            "params": config.num_params(),
            "config": run.label,
            "peer": run.peer,
            "stage": run.stage,
            "micro_batch": micro_batch,
            "seq_len": args.seq_len,
            "tokens_per_step": work.tokens_per_step,
            "warmup": args.warmup,
            "steps": args.steps,
            "compile": args.compile,
            **({"compile_backend": args.compile_backend} if run.peer in COMPILED_PEERS else {}),
            "activation_checkpointing": args.activation_checkpointing,
            "device": str(device),
        }
        record.update(run_one(run, work, batch, args.warmup, args.steps))
        if run.peer in ("torch", "torch-compiled") and "tokens_per_s" in record:
            baseline[(run.model, run.peer)] = record["tokens_per_s"]
        record["ratio_to_torch"] = ratio(record, baseline.get((run.model, "torch")))
        if run.peer in COMPILED_PEERS:
            record["ratio_to_torch_compiled"] = ratio(record, baseline.get((run.model, "torch-compiled")))
        del batch, tokens
        emit(record, args.out)
        rows.append(record)
    print_table(rows, TABLE)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
