"""Benchmark: one CPU Adam(W) step, ours against torch's fused and foreach AdamW and DeepSpeedCPUAdam.

Prints JSON lines on stdout (a readable table goes to stderr):

- ``env``: torch version, threads, CPU model, cache sizes, memory;
- ``result``: one per size and variant: median/min/max seconds per step, params/s, effective GB/s;
- ``error``: a variant or size that could not run (e.g. DeepSpeed's JIT build failing), with the reason;
- ``summary``: one per size: ours against the best baseline, and the offload path against the naive one.

Effective GB/s counts the least traffic a step can do: read p, g, m, v and write p, m, v = 28 B/param with
fp32 grads; +2 B/param when bf16 weights are written out; with bf16 grads in and bf16 weights out it is
2 + 12 + 12 + 2 = 28 B. The `master_adam_bf16_states*` rows step bf16 masters and bf16 moments (issue 32:
`precision.MasterAdam`, the offloaded step with `bf16.bf16_master_weights_and_grads`), 14 B/param, with
and without stochastic rounding, in `precision.master_kernel`'s one compiled pass (the default at these
sizes) and in the chunked step it replaced (`_chunked`): on the 2-core dev box at 100M, 0.82 and 1.59 G
params/s one-pass against 0.43 and 0.58 chunked (the rounding's hash is most of the one pass's work there).
``memcpy`` (one fp32 tensor copied into another, 8 B/element read + written) is measured in the same
rounds as the physical reference.

Variants run interleaved: each round times every variant once, so load from other processes hits all of
them alike; the first ``--warmup`` rounds (which also allocate optimizer state) are dropped. All
variants share one parameter tensor and its gradient; each optimizer keeps its own state.

Usage: ``python scripts/bench/cpu_adam.py [--sizes 100e6 1e9] [--rounds 5] [--threads N]``. Bind the
process to its cores (``taskset``/``numactl``) for stable numbers. DeepSpeedCPUAdam runs when ``deepspeed``
imports; its first use JIT-builds the cpu_adam op with ninja (set ``TORCH_EXTENSIONS_DIR`` to keep the
build cache out of ``~/.cache``). With DeepSpeed in its own venv, run from the repo root as
``PYTHONPATH=. <ds-venv>/bin/python scripts/bench/cpu_adam.py``. Memory: about 64 B per parameter
(all optimizers' states live at once), i.e. ~64 GB at 1B; a size that does not fit is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from runtime.ops.adam import CPUAdam, default_chunk_elems
from scripts.bench import common

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
FP32_STEP_BYTES = 28  # read p, g, m, v + write p, m, v, all fp32
BF16_OUT_BYTES = 2
BF16_STATE_STEP_BYTES = 14  # bf16 masters and moments: read g, p, m, v (8) + write p, m, v (6)


@dataclass(frozen=True)
class Variant:
    name: str
    bytes_per_param: int
    run: Callable[[], object]


def _sig(x: float, digits: int = 4) -> float:
    """x rounded to significant digits: microsecond steps and second-long steps both stay readable."""
    return float(f"{x:.{digits}g}")


def emit(record: dict, out: Path | None) -> None:
    common.emit({"bench": "cpu_adam", **record}, out)


def _filled(n: int, seed: int, scale: float) -> torch.Tensor:
    """n fp32 values: a random 1M-element block tiled (fast and parallel at 1B, unlike randn)."""
    gen = torch.Generator().manual_seed(seed)
    block = torch.randn(min(n, 1 << 20), generator=gen) * scale
    out = torch.empty(n)
    whole = n - n % block.numel()
    out[:whole].view(-1, block.numel()).copy_(block)
    out[whole:].copy_(block[: n - whole])
    return out


def _cache_bytes(level: int) -> int | None:
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")):
        try:
            if (
                int((index / "level").read_text()) == level
                and (index / "type").read_text().strip() != "Instruction"
            ):
                text = (index / "size").read_text().strip()
                units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
                return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        except (OSError, ValueError):
            return None
    return None


def env_record(threads: int) -> dict:
    import psutil

    return {
        "event": "env",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": threads,
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu": common.cpu_model(),
        "l2_bytes_per_core": _cache_bytes(2),
        "l3_bytes": _cache_bytes(3),
        "mem_total_gb": round(psutil.virtual_memory().total / 1e9, 1),
        "default_chunk_elems": default_chunk_elems(threads),
    }


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """DeepSpeed's logger and the ninja build write to stdout; keep stdout JSON only."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def deepspeed_optimizer(param: torch.Tensor, size: int, out: Path | None) -> torch.optim.Optimizer | None:
    t0 = time.perf_counter()
    stage = "import"
    try:
        with _stdout_to_stderr():
            from deepspeed.ops.adam import DeepSpeedCPUAdam as DsCPUAdam

            stage = "build"
            opt = DsCPUAdam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    except Exception as e:  # report and go on: DeepSpeed is a peer to compare with, not a dependency
        emit(
            {
                "event": "error",
                "size": size,
                "variant": "deepspeed_cpu_adam",
                "stage": stage,
                "error": f"{type(e).__name__}: {e}"[:600],
                "seconds": round(time.perf_counter() - t0, 2),
            },
            out,
        )
        return None
    emit({"event": "deepspeed_ready", "size": size, "seconds": round(time.perf_counter() - t0, 2)}, out)
    return opt


def _bytes_needed(n: int, with_ds: bool) -> int:
    # p, g fp32; g bf16; out bf16; memcpy target; m+v for fused, foreach, ours (+ DeepSpeed);
    # foreach temporaries (~3 fp32 copies); the unchunked bf16-grad variant's fp32 temporary.
    # four MasterAdams: their own bf16 masters and bf16 moments (6 B/param each)
    optimizers = 4 if with_ds else 3
    return n * (4 + 4 + 2 + 2 + 4 + 8 * optimizers + 12 + 4 + 4 * 6)


def build_variants(n: int, chunks: list[int], with_ds: bool, out: Path | None) -> list[Variant]:
    param = _filled(n, seed=0, scale=1.0)
    grad32 = _filled(n, seed=1, scale=1e-3)
    param.grad = grad32
    grad16 = grad32.to(torch.bfloat16)
    out16 = torch.empty(n, dtype=torch.bfloat16)
    copy_dst = torch.empty(n)

    fused = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
    foreach = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=True)
    ours = CPUAdam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True)

    def ours_with(chunk: int | None, grad: torch.Tensor, out: torch.Tensor | None) -> Callable[[], object]:
        def run() -> object:
            ours.chunk_elems = chunk
            return ours.step(grads=[grad], out=[out] if out is not None else None)

        return run

    variants = [
        Variant("memcpy", 8, lambda: copy_dst.copy_(param)),
        Variant("torch_adamw_fused", FP32_STEP_BYTES, fused.step),
        Variant("torch_adamw_foreach", FP32_STEP_BYTES, foreach.step),
    ]
    if with_ds:
        ds = deepspeed_optimizer(param, n, out)
        if ds is not None:
            variants.append(Variant("deepspeed_cpu_adam", FP32_STEP_BYTES, ds.step))
    variants += [
        Variant("ours", FP32_STEP_BYTES, ours.step),
        Variant("ours_out_bf16", FP32_STEP_BYTES + BF16_OUT_BYTES, ours_with(None, grad32, out16)),
        Variant("ours_out_bf16_unchunked", FP32_STEP_BYTES + BF16_OUT_BYTES, ours_with(0, grad32, out16)),
        # The offload path: bf16 grads landed from the GPU, bf16 weights to send back.
        Variant("ours_bf16grad_out_bf16", FP32_STEP_BYTES, ours_with(None, grad16, out16)),
    ]
    default = default_chunk_elems()
    for chunk in chunks:
        if chunk != default:
            name = f"ours_bf16grad_out_bf16_chunk{chunk}"
            variants.append(Variant(name, FP32_STEP_BYTES, ours_with(chunk, grad16, out16)))
    variants.append(Variant("ours_bf16grad_out_bf16_unchunked", FP32_STEP_BYTES, ours_with(0, grad16, out16)))
    # issue 32's 16-bit state: bf16 masters and moments (precision.MasterAdam, what the offloaded step
    # runs with bf16.bf16_master_weights_and_grads), with and without stochastic rounding
    from runtime.precision.master_adam import MasterAdam

    # ("_chunked": the step before precision.master_kernel's one-pass kernel, forced by its switch)
    for rounding in (True, False):
        for one_pass in (True, False):
            master = torch.nn.Parameter(param.detach().to(torch.bfloat16))
            master.grad = grad16
            bf16_adam = MasterAdam(
                [master], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                state_dtype=torch.bfloat16, stochastic_rounding=rounding,
            )  # fmt: skip
            name = "master_adam_bf16_states" + ("_sr" if rounding else "") + ("" if one_pass else "_chunked")
            variants.append(Variant(name, BF16_STATE_STEP_BYTES, _switched(bf16_adam.step, one_pass)))
    return variants


def _switched(step: Callable[[], object], one_pass: bool) -> Callable[[], None]:
    """`step` run with the one-pass master step switched on or off (DSLAUNCH_FUSED_MASTER_STEP)."""

    def run() -> None:
        saved = os.environ.get("DSLAUNCH_FUSED_MASTER_STEP")
        os.environ["DSLAUNCH_FUSED_MASTER_STEP"] = "1" if one_pass else "0"
        try:
            step()
        finally:
            if saved is None:
                del os.environ["DSLAUNCH_FUSED_MASTER_STEP"]
            else:
                os.environ["DSLAUNCH_FUSED_MASTER_STEP"] = saved

    return run


def time_variants(variants: list[Variant], warmup: int, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(warmup + rounds):
        for v in variants:
            t0 = time.perf_counter()
            v.run()
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[v.name].append(dt)
    return times


def bench_size(n: int, args: argparse.Namespace) -> list[dict]:
    import psutil

    with_ds = not args.no_deepspeed
    need, avail = _bytes_needed(n, with_ds), psutil.virtual_memory().available
    if need > 0.9 * avail:
        emit(
            {
                "event": "error",
                "size": n,
                "variant": "all",
                "error": f"needs ~{need / 1e9:.1f} GB, {avail / 1e9:.1f} GB available; pass smaller --sizes",
            },
            args.out,
        )
        return []
    variants = build_variants(n, args.chunks, with_ds, args.out)
    times = time_variants(variants, args.warmup, args.rounds)
    memcpy_gbps = 8 * n / statistics.median(times["memcpy"]) / 1e9
    rows = []
    for v in variants:
        ts = times[v.name]
        med = statistics.median(ts)
        gbps = v.bytes_per_param * n / med / 1e9
        row = {
            "event": "result",
            "size": n,
            "variant": v.name,
            "bytes_per_param": v.bytes_per_param,
            "median_s": _sig(med),
            "min_s": _sig(min(ts)),
            "max_s": _sig(max(ts)),
            "params_per_s": round(n / med),
            "gbps": _sig(gbps),
            "vs_memcpy": round(gbps / memcpy_gbps, 3),
        }
        emit(row, args.out)
        rows.append(row)
    emit(summarize(n, rows), args.out)
    return rows


def summarize(n: int, rows: list[dict]) -> dict:
    by = {r["variant"]: r for r in rows}
    baselines = [
        name for name in ("torch_adamw_fused", "torch_adamw_foreach", "deepspeed_cpu_adam") if name in by
    ]
    best = min(baselines, key=lambda name: by[name]["median_s"])
    offload = min(
        (
            r
            for r in rows
            if r["variant"].startswith("ours_bf16grad_out_bf16") and "unchunked" not in r["variant"]
        ),
        key=lambda r: r["median_s"],
    )
    naive = by["ours_bf16grad_out_bf16_unchunked"]
    timed = [r for r in rows if r["variant"] != "memcpy"]
    return {
        "event": "summary",
        "size": n,
        "best_baseline": best,
        "best_baseline_s": by[best]["median_s"],
        "ours_s": by["ours"]["median_s"],
        # > 1: ours is faster than the best of torch fused/foreach and DeepSpeedCPUAdam.
        "ours_speedup_vs_best": round(by[best]["median_s"] / by["ours"]["median_s"], 3),
        "ours_gbps": by["ours"]["gbps"],
        "memcpy_gbps": by["memcpy"]["gbps"],
        "out_bf16_chunked_vs_unchunked": round(
            by["ours_out_bf16_unchunked"]["median_s"] / by["ours_out_bf16"]["median_s"], 3
        ),
        "offload_best_variant": offload["variant"],
        "offload_s": offload["median_s"],
        "offload_gbps": offload["gbps"],
        # The offload path (bf16 grads in, bf16 weights out) against converting with full temporaries.
        "offload_speedup_vs_unchunked": round(naive["median_s"] / offload["median_s"], 3),
        "offload_vs_plain_fp32_step": round(by["ours"]["median_s"] / offload["median_s"], 3),
        # Spread of the timed rounds, (max - min) / median, worst variant: how noisy the host was.
        "noise": round(max((r["max_s"] - r["min_s"]) / r["median_s"] for r in timed), 3),
    }


TABLE = (
    common.Column("size", "size", "d", 12),
    common.Column("variant", "variant", width=42),
    common.Column("median s", "median_s", ".4f", 9),
    common.Column("Gparam/s", lambda r: r["params_per_s"] / 1e9, ".3f", 9),
    common.Column("GB/s", "gbps", ".1f", 7),
    common.Column("x memcpy", "vs_memcpy", ".2f", 8),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", type=float, default=[100e6, 1e9], help="parameters per step")
    ap.add_argument("--rounds", type=int, default=5, help="timed steps per variant (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (allocate state)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--chunks",
        nargs="*",
        type=float,
        default=[1 << 18, 1 << 22],
        help="extra chunk sizes (elements) for the offload variant, besides the default",
    )
    ap.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    common.add_out_argument(ap, "cpu-adam")
    args = ap.parse_args(argv)
    args.out = common.out_file(args.out, "cpu-adam")
    for name in ("rounds", "warmup"):
        if getattr(args, name) < (1 if name == "rounds" else 0):
            ap.error(f"--{name} must be >= {1 if name == 'rounds' else 0}")
    if any(s < 1 for s in args.sizes):
        ap.error("--sizes must be >= 1")
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be >= 1")
    args.sizes = [int(s) for s in args.sizes]
    args.chunks = [int(c) for c in args.chunks]
    if any(c < 1 for c in args.chunks):
        ap.error("--chunks must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    emit(env_record(torch.get_num_threads()), args.out)
    all_rows: list[dict] = []
    for n in args.sizes:
        all_rows += bench_size(n, args)
    common.print_table(all_rows, TABLE)
    return 0 if all_rows else 1


if __name__ == "__main__":
    sys.exit(main())
