"""The optimizer step's host time: our fused master step against torch's fused AdamW (issue 33).

At world 1 our compiled engine's step of a 3B Llama was bound by the host, not the GPU: 141 compiled calls,
one per segment, took 41-44 ms to launch 35 ms of kernels (BENCHMARKS.md). This measures that host time
where no GPU hides it. The model has the 3B Llama's tensors (28 layers, 24 heads of which 8 key/value, a
tied head) with every dimension divided by --shrink (32 by default: 1/1024 of the elements), and the fused
step's run size (runtime/precision/fused_master.py RUN_ELEMENTS) divided by the square of it, so the step
makes the same segments at every factor (141 at 28 layers, at 1/64, 1/256 and 1/1024) while its kernels
cost next to nothing.

On CPU (no GPU, or DS_ACCELERATOR=cpu) the fused step is compiled with --backend (inductor by default,
as on a GPU; it needs a C++ compiler, and its first step compiles for a minute or more; `eager` times
dynamo's tracing path instead, which the CPU tests use). On CUDA `host_ms` is how long `engine.step()`
takes to return (kernels queued) and `step_ms` the same with a synchronize after it.

Baseline, same process: `torch.optim.AdamW(fused=True)` stepping the same parameters in fp32, as a
compiled plain loop does. One JSON line: the medians over --steps of ours and torch's, and `segments`, the
update's kernels a step.

    DS_ACCELERATOR=cpu python scripts/bench/step_host.py            # ~2 minutes on 2 cores, cold
    DS_ACCELERATOR=cpu python scripts/bench/step_host.py --backend eager --layers 2 --steps 3   # smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.bench.common import add_out_argument, emit, out_file, synchronize  # noqa: E402

FULL = {"hidden": 3072, "intermediate": 8192, "vocab": 32000}


def build(layers: int, shrink: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=FULL["vocab"] // shrink,
        hidden_size=FULL["hidden"] // shrink,
        intermediate_size=FULL["intermediate"] // shrink,
        num_hidden_layers=layers,
        # 3 heads, 1 for keys and values: the 3B's projections (3072 -> 3072, 3072 -> 1024) shrunk alike
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=FULL["hidden"] // shrink // 3,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def use_backend(backend: str) -> None:
    """The fused step compiled with `backend` wherever it runs (the CPU default is dynamo's eager one)."""
    from runtime.precision import fused_master

    built = fused_master.compile_step
    fused_master.compile_step = lambda device: built(device, backend)


def timed(step: Any, device: torch.device, steps: int, before: Any = None) -> tuple[float, float]:
    """Median ms of `step()` returning, and of it with a synchronize after, over `steps` calls."""
    host, total = [], []
    for _ in range(steps):
        if before is not None:
            before()
        synchronize(device)
        start = time.perf_counter()
        step()
        returned = time.perf_counter()
        synchronize(device)
        host.append(returned - start)
        total.append(time.perf_counter() - start)
    return statistics.median(host) * 1e3, statistics.median(total) * 1e3


SEGMENTS: list[int] = []  # each fused step's segment count (`count_segments`)


def count_segments() -> None:
    """Record in SEGMENTS how many segments each fused step updates."""
    from runtime.precision import fused_master

    step = fused_master.FusedMasterAdam.step

    def counting(self: Any, optimizer: Any, segs: Any, *rest: Any, **kw: Any) -> None:
        SEGMENTS.append(sum(len(group) for group in segs))
        step(self, optimizer, segs, *rest, **kw)

    fused_master.FusedMasterAdam.step = counting  # type: ignore[method-assign]


def measure(args: argparse.Namespace, shrink: int, device: torch.device) -> dict[str, Any]:
    import runtime
    from runtime.precision import fused_master

    fused_master.RUN_ELEMENTS = (1 << 24) // (shrink * shrink)
    SEGMENTS.clear()
    model = build(args.layers, shrink).to(device)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
    }
    engine, *_ = runtime.initialize(model=model, model_parameters=model.parameters(), config=config)
    batch = torch.randint(0, FULL["vocab"] // shrink, (1, 9), device=device)

    def backward() -> None:
        engine.backward(engine(input_ids=batch, labels=batch).loss)

    start = time.perf_counter()
    backward()
    engine.step()  # compiles the step
    first_s = time.perf_counter() - start
    backward()
    engine.step()
    ours = timed(engine.step, device, args.steps, before=backward)
    if not SEGMENTS:
        raise SystemExit("the fused step did not run: see the engine's log for why")

    reference = build(args.layers, shrink).to(device)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    for p in reference.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    theirs = timed(optimizer.step, device, args.steps)
    return {
        "bench": "step_host",
        "device": str(device),
        "backend": args.backend if device.type == "cpu" else "inductor",
        "stage": args.stage,
        "layers": args.layers,
        "shrink": shrink,
        "parameters": sum(p.numel() for p in reference.parameters()),
        "tensors": sum(1 for _ in reference.parameters()),
        "segments": SEGMENTS[-1],
        "first_step_s": round(first_s, 1),
        "ours_host_ms": round(ours[0], 2),
        "ours_step_ms": round(ours[1], 2),
        "torch_host_ms": round(theirs[0], 2),
        "torch_step_ms": round(theirs[1], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument(
        "--shrink",
        default="32",
        help="every dimension divided by this; several, comma-separated, measure each in turn (a row each)",
    )
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--backend", default="inductor", help="the fused step's compiler on CPU")
    add_out_argument(parser, "step-host")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("DSLAUNCH_FUSED_MASTER_STEP", "1")
    on_gpu = os.environ.get("DS_ACCELERATOR") != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    if device.type == "cpu":
        use_backend(args.backend)
    count_segments()
    for shrink in (int(factor) for factor in args.shrink.split(",")):
        emit(measure(args, shrink, device), out_file(args.out, "step-host"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
