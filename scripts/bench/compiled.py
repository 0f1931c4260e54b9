"""Compiled training throughput on one device: our compiled engine at ZeRO 0, 2 and 3 against a compiled plain
PyTorch loop (issue 33), for GPT-2 XL and a ~3B Llama-shaped model.

Each model runs in a process of its own (this script starts itself once per model with --only), which
measures, in this order: `torch-compiled` (plain PyTorch: fp32 weights, bf16 autocast, fused AdamW,
`torch.compile(model)`), then `ours-compiled-zeroS` for each of --stages (runtime.initialize with bf16 and
that ZeRO stage, then `engine.compile()`: runtime/compile.py decides the regions). Every configuration is
built and compiled once, trained --warmup steps (the compilation happens there), then timed in --repeats
windows of --steps steps each (every step between two synchronizations; a window's median step time gives
its tokens/s). A row reports the median, min and max over the windows, MFU of the median (989 dense bf16
TFLOP/s; 6N + 12·L·d·T FLOPs per token) and `ratio_to_torch_compiled`, both medians from the same process.
On a GPU a row also gives `compute_ms` and `update_ms` (the median forward+backward and optimizer step
between CUDA events: where a gap lies) and `tokens_per_s_steady` / `ratio_steady` (--steps steps back to
back, one synchronization at each end, as a training loop runs: the host's launch time hides behind the GPU).
--profile_update adds `update_profile` to our rows: 3 optimizer steps under torch.profiler, the step's host
milliseconds, its kernels (count and GPU milliseconds) and its top ops by GPU and by host time.
--run_elements N and --skip_guard_eval change our step for a measurement of its host time (the fused
step's launches are host-bound): N elements a run instead of 16M, or dynamo's skip_guard_eval_unsafe
stance around the step once it is compiled. Our rows record both.

Models: `xl` is our GPT at GPT-2 XL sizes (1.56B, micro batch 8 x 1024); `llama3b` a transformers
LlamaForCausalLM built from a LlamaConfig here (Llama-3.2-3B's shape: 28 layers, d 3072, 24 heads / 8 KV
heads, MLP 8192, vocab 128256, tied head; 3.2B; micro batch 4 x 2048; sdpa attention; no download).
--tiny swaps both for tiny sizes on the CPU with backend "eager" (the smoke check).

    python scripts/bench/compiled.py --repeats 3 --out                      # H200: both models
    python scripts/bench/compiled.py --models llama3b --stages 0,2 --fused_ab   # the fused master step's A/B
    python scripts/bench/compiled.py --models llama3b --autograd_stages 2   # one rank's gradients: A/B
    python scripts/bench/compiled.py --tiny --steps 2 --warmup 1 --repeats 2 # CPU smoke check

The per-unit plan's price (issue 33): at ZeRO-3 over several ranks (or with `offload_param`) the engine
compiles each gather unit's forward on its own, the glue between them eager (runtime/compile.py).
--regions_stages 3 adds `ours-regions-zeroS` rows: that plan on this one rank, where nothing is gathered,
so the row against `ours-compiled-zeroS` is what the plan's graph boundaries cost without the gathers.

DeepSpeed beside us (issue 33): --ds_stages 0,2,3 adds `deepspeed-compiled-zeroS` rows (deepspeed.initialize
with the same config, torch's AdamW inside it, then DeepSpeed's own `engine.compile()`), and
--deepcompile_stages 3 `deepspeed-deepcompile-zeroS` rows (the config's `"compile": {"deepcompile": true}`,
DeepSpeed's compiler passes). Real DeepSpeed must be what `import deepspeed` finds: run without compat/ on
PYTHONPATH. A DeepSpeed row that fails reports its error and does not fail the run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from scripts.bench.common import (
    add_out_argument,
    emit,
    environment,
    init_single_process_group,
    median_time,
    out_file,
    real_deepspeed,
    steady_time,
)
from scripts.bench.profiling import phases, profile_update

PEAK_BF16_TFLOPS = 989.0
MODELS = ("xl", "llama3b")
LR, WEIGHT_DECAY = 1e-4, 0.01


def build(name: str, tiny: bool, device: torch.device) -> tuple[torch.nn.Module, float, int, int, int]:
    """(model, FLOPs per token, micro batch, sequence length, vocabulary) of a named model, seeded."""
    torch.manual_seed(0)
    if name == "xl":
        from runtime.models import GPT, GPTConfig

        config = GPTConfig.named("tiny", vocab_size=256) if tiny else GPTConfig.named("xl")
        micro, seq = (2, 64) if tiny else (8, 1024)
        with torch.device(device):
            model: torch.nn.Module = GPT(config)
        return model, config.flops_per_token(seq), micro, seq, config.vocab_size
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = (
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256}
        if tiny else
        {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
         "num_key_value_heads": 8, "vocab_size": 128256}
    )  # fmt: skip
    micro, seq = (2, 64) if tiny else (4, 2048)
    config = LlamaConfig(**sizes, max_position_embeddings=seq, tie_word_embeddings=True, rope_theta=500000.0)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    flops = 6.0 * n + 12.0 * config.num_hidden_layers * config.hidden_size * seq
    return model, flops, micro, seq, config.vocab_size


def loss_of(model: Any, name: str, batch: torch.Tensor) -> torch.Tensor:
    if name == "xl":
        return model(batch[:, :-1], batch[:, 1:]).loss
    return model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss


def setup(
    peer: str, stage: int, name: str, args: argparse.Namespace, batch: torch.Tensor
) -> tuple[Callable[[], torch.Tensor], Callable[[], None]]:
    """(forward and backward of one step, returning the loss; the optimizer step) of one configuration."""
    model = build(name, args.tiny, args.device)[0]
    backend = "eager" if args.tiny else args.backend
    if peer == "torch-compiled":
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=args.device.type == "cuda"
        )
        compiled = torch.compile(model, backend=backend)

        def torch_compute() -> torch.Tensor:
            with torch.autocast(args.device.type, dtype=torch.bfloat16):
                loss = loss_of(compiled, name, batch)
            loss.backward()
            return loss.detach()

        def torch_update() -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return torch_compute, torch_update
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch.shape[0],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # set: DeepSpeed 0.19's default is 1.0
        "steps_per_print": 0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
    }
    if peer.startswith("deepspeed"):
        import logging

        deepspeed = real_deepspeed()  # never our compat package under its name
        deepspeed.utils.logger.setLevel(logging.WARNING)  # keep stdout for our JSON lines
        config["optimizer"]["params"]["torch_adam"] = True  # torch's AdamW: no FusedAdam JIT build
        config["steps_per_print"] = 1 << 30  # DeepSpeed takes the step count modulo it: 0 divides by zero
        if peer == "deepspeed-deepcompile":
            config["compile"] = {"deepcompile": True}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        engine.compile(backend=backend)
    else:
        import runtime
        from runtime.compile import block_names, compile_model

        engine, *_ = runtime.initialize(model=model, model_parameters=model.parameters(), config=config)
        if peer == "ours-regions":  # stage 3's per-unit plan on one rank: each block and the head alone
            compile_model(engine.module, block_names(engine.module), {"backend": backend})
        else:
            engine.compile(backend=backend)

    def engine_compute() -> torch.Tensor:
        loss = loss_of(engine, name, batch)
        engine.backward(loss)
        return loss.detach()

    return engine_compute, engine.step


def measure(peer: str, stage: int, name: str, args: argparse.Namespace) -> dict[str, Any]:
    flops, micro, seq, vocab = _sizes(name, args)
    gen = torch.Generator().manual_seed(1234)
    batch = torch.randint(0, vocab, (micro, seq + 1), generator=gen).to(args.device)
    from runtime.compile import compile_counts

    before = compile_counts()
    compute, update = setup(peer, stage, name, args, batch)

    def step() -> torch.Tensor:
        loss = compute()
        update()
        return loss

    losses = [step() for _ in range(args.warmup)]
    # what this configuration compiled in its warm-up (dynamo's counters are the process's: the difference)
    compiled = {key: value - before[key] for key, value in compile_counts().items()}
    if args.skip_guard_eval and peer.startswith("ours"):
        update = guards_skipped(update)  # `step` reads the name at each call: from here on, this one
    windows = []
    for _ in range(args.repeats):
        median, _times = median_time(lambda: losses.append(step()), args.device, 0, args.steps)
        windows.append(micro * seq / median)
    tokens = statistics.median(windows)
    tflops = flops * tokens / 1e12
    result = {
        "tokens_per_s": round(tokens, 1),
        "tokens_per_s_min": round(min(windows), 1),
        "tokens_per_s_max": round(max(windows), 1),
        "tflops": float(f"{tflops:.4g}"),
        "mfu": round(tflops / PEAK_BF16_TFLOPS, 4),
        "loss_first": round(float(losses[0]), 4),
        "loss_last": round(float(losses[-1]), 4),
        "micro_batch": micro,
        "seq_len": seq,
        "graphs_compiled": compiled["graphs_compiled"],
        "graph_breaks": compiled["graph_breaks"],
    }
    if args.device.type == "cuda":
        result.update(phases(compute, update, args.steps, losses))
        steady = steady_time(lambda: losses.append(step()), args.device, args.steps)
        result["tokens_per_s_steady"] = round(micro * seq / steady, 1)
        result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(args.device) / 2**30, 2)
    if args.profile_update and not peer.startswith("torch"):
        result["update_profile"] = profile_update(compute, update, losses, args.device)
    return result


def guards_skipped(update: Callable[[], None]) -> Callable[[], None]:
    """`update` under dynamo's `skip_guard_eval_unsafe` stance, once everything it calls is compiled: only
    the guards that tell cached graphs apart run, not every guard of every call (the fused step's launches
    are host-bound: BENCHMARKS.md, issue 33). A measurement, not a setting of ours: it is unsafe wherever
    an input could change what was compiled."""

    def skipping() -> None:
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            update()

    return skipping


def _sizes(name: str, args: argparse.Namespace) -> tuple[float, int, int, int]:
    """(FLOPs per token, micro batch, sequence, vocabulary) without building the model's weights."""
    with torch.device("meta"):
        _, flops, micro, seq, vocab = build(name, args.tiny, torch.device("meta"))
    return flops, args.micro_batch or micro, seq, vocab


def release(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()  # compiled graphs hold the previous model's tensors
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_model(name: str, args: argparse.Namespace) -> int:
    os.environ["DS_ACCELERATOR"] = args.device.type
    from runtime.precision import fused_master

    if args.run_elements:
        fused_master.RUN_ELEMENTS = args.run_elements
    init_single_process_group(args.device)
    base: float | None = None
    base_steady: float | None = None
    failed = False
    runs = [("torch-compiled", -1, "")] + [("ours-compiled", s, "") for s in args.stages]
    if args.fused_ab:  # each stage again with the fused master step (precision/fused_master.py)
        runs += [("ours-compiled", s, "-fused") for s in args.stages]
    runs += [("ours-compiled", s, "-autograd") for s in args.autograd_stages]
    runs += [("ours-compiled", s, "-flat") for s in args.flat_stages]
    runs += [("ours-regions", s, "") for s in args.regions_stages]
    runs += [("deepspeed-compiled", s, "") for s in args.ds_stages]
    runs += [("deepspeed-deepcompile", s, "") for s in args.deepcompile_stages]
    for peer, stage, variant in runs:
        label = peer if stage < 0 else f"{peer}-zero{stage}{variant}"
        if args.fused_ab and variant in ("", "-fused"):  # otherwise the caller's own setting stands
            os.environ["DSLAUNCH_FUSED_MASTER_STEP"] = "1" if variant else "0"
        if variant in ("-autograd", "-flat"):  # one rank's gradients: autograd's tensors, or the flat buffer
            os.environ["DSLAUNCH_AUTOGRAD_GRADS"] = "1" if variant == "-autograd" else "0"
        else:
            os.environ.pop("DSLAUNCH_AUTOGRAD_GRADS", None)
        record: dict[str, Any] = {"bench": "compiled", "model": name, "config": label, "stage": stage}
        record.update(repeats=args.repeats, steps=args.steps, warmup=args.warmup)
        if peer.startswith("ours"):
            record.update(run_elements=fused_master.RUN_ELEMENTS, skip_guard_eval=args.skip_guard_eval)
        release(args.device)
        try:
            record.update(measure(peer, stage, name, args))
        except Exception as exc:  # one failed configuration must not hide the others' numbers
            failed = failed or not peer.startswith("deepspeed")  # the peer's failures are its own
            record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        finally:
            release(args.device)
        if peer == "torch-compiled":
            base, base_steady = record.get("tokens_per_s"), record.get("tokens_per_s_steady")
        if base and "tokens_per_s" in record:
            record["ratio_to_torch_compiled"] = round(record["tokens_per_s"] / base, 4)
        if base_steady and "tokens_per_s_steady" in record:
            record["ratio_steady"] = round(record["tokens_per_s_steady"] / base_steady, 4)
        emit(record, args.out)
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()
    return 1 if failed else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--only", choices=MODELS, help=argparse.SUPPRESS)  # the per-model process
    parser.add_argument("--stages", default="0,2,3", help="ZeRO stages of ours")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--backend", default="inductor")
    # the 3B model's default of 4 x 2048 needs about 90 GiB: an 80 GB card takes 2
    parser.add_argument("--micro_batch", type=int, help="sequences a step (default: the model's)")
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU, backend eager")
    parser.add_argument(
        "--fused_ab",
        action="store_true",
        help="also each stage with DSLAUNCH_FUSED_MASTER_STEP=1 (rows *-fused)",
    )
    parser.add_argument(
        "--autograd_stages",
        default="",
        help="ZeRO stages of ours again with DSLAUNCH_AUTOGRAD_GRADS=1 (rows ours-compiled-zeroS-autograd): "
        "one rank's gradients as autograd's own tensors, not the flat buffer (runtime/zero/one_rank.py)",
    )
    parser.add_argument(
        "--flat_stages",
        default="",
        help="ZeRO stages of ours again with DSLAUNCH_AUTOGRAD_GRADS=0 (rows ours-compiled-zeroS-flat): "
        "one rank's gradients in the flat buffer, not autograd's own tensors (runtime/zero/one_rank.py)",
    )
    parser.add_argument(
        "--regions_stages",
        default="",
        help="ZeRO stages of ours compiled per region as stage 3 over several ranks compiles it (each block "
        "and the head, the glue eager), on this one rank without the gathers: the structure's own cost "
        "(rows ours-regions-zeroS)",
    )
    parser.add_argument(
        "--profile_update",
        action="store_true",
        help="each row of ours also profiles 3 optimizer steps (update_profile: host ms, kernels, top ops)",
    )
    parser.add_argument(
        "--run_elements",
        type=int,
        help="our fused step's run size in elements (precision/fused_master.py RUN_ELEMENTS, 16M): larger "
        "joins more gradients into a launch, fewer launches for more copying",
    )
    parser.add_argument(
        "--skip_guard_eval",
        action="store_true",
        help="our optimizer step under dynamo's skip_guard_eval_unsafe after the warm-up: what the guards "
        "of its launches cost the host",
    )
    parser.add_argument(
        "--ds_stages",
        default="",
        help="ZeRO stages of DeepSpeed's engine with engine.compile() (rows deepspeed-compiled-zeroS; "
        "DeepSpeed importable without compat/ on the path)",
    )
    parser.add_argument(
        "--deepcompile_stages",
        default="",
        help='the same with the config\'s "compile": {"deepcompile": true} (rows '
        "deepspeed-deepcompile-zeroS; DeepCompile covers ZeRO-1 and 3)",
    )
    add_out_argument(parser, "compiled")
    args = parser.parse_args(argv)
    args.out = out_file(args.out, "compiled")
    args.stages = [int(s) for s in str(args.stages).split(",") if s.strip()]
    args.ds_stages = [int(s) for s in str(args.ds_stages).split(",") if s.strip()]
    args.regions_stages = [int(s) for s in str(args.regions_stages).split(",") if s.strip()]
    args.flat_stages = [int(s) for s in str(args.flat_stages).split(",") if s.strip()]
    args.autograd_stages = [int(s) for s in str(args.autograd_stages).split(",") if s.strip()]
    args.deepcompile_stages = [int(s) for s in str(args.deepcompile_stages).split(",") if s.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in MODELS for m in models):
        parser.error(f"--models: choose from {', '.join(MODELS)}")
    args.models = models
    use_cuda = torch.cuda.is_available() and not args.tiny and os.environ.get("DS_ACCELERATOR") != "cpu"
    args.device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.only:
        return run_model(args.only, args)
    emit({"bench": "compiled", "event": "start", **environment(str(args.device)), "args": argv}, args.out)
    codes = []
    for name in args.models:  # one process per model: nothing compiled or allocated carries over
        argv_model = [*argv, "--only", name]
        if args.out is not None and "--out" not in argv:
            argv_model += ["--out", str(args.out)]
        codes.append(subprocess.run([sys.executable, __file__, *argv_model], check=False).returncode)
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
