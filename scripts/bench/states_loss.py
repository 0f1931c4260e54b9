"""16-bit masters and optimizer states against fp32 ones (issue 32 (b)): the loss over the same steps.

One process, world size 1, our engine (runtime.initialize), a GPT of runtime.models (GPT-2 small by default,
124M; `--model medium`, 355M; both with GPT-2's padded vocabulary of 50304, of which the byte tokens use the
first 256), bf16, ZeRO stage 2 without offload, AdamW (lr --lr 3e-4, betas 0.9/0.999, weight decay 0.01),
gradient clipping at --clip 1.0, one micro-batch of --micro_batch x --seq_len tokens a step, no accumulation.
Each setting builds the model from the same seed (the same initial weights) and trains --steps steps (300)
on the same batches of a real corpus: the Python standard library's sources (common.stdlib_corpus, as
fp8.py's --loss_steps), bytewise tokens, consecutive windows of --seq_len + 1 bytes (inputs, next bytes).

Settings (--settings, in this order by default):

    fp32_states     plain bf16: fp32 master weights and fp32 Adam moments (the baseline)
    bf16_states     bf16.bf16_master_weights_and_grads + bf16.bf16_optimizer_states, stochastic rounding
                    of the bf16 masters on (bf16.stochastic_rounding, the default)
    bf16_states_nosr  the same with stochastic_rounding false: round to nearest, small updates are lost

It prints each setting's loss every 25 steps (and at the last), the mean of its last 50 steps, and that
mean's relative difference to fp32_states' (issue 32's goal: within 1%; the baseline runs first where
--settings names it; without it the ratios are null). Output: one JSON line per setting
(`"bench": "states_loss"`: the settings' keys as the engine resolved them, the losses every 25 steps, the
first and final loss, the last-50 mean, `rel_to_fp32_states`, tokens/s, peak GPU memory) and a summary
line, via common.emit (commit, machine, command); --out FILE appends them to FILE too.

    python scripts/bench/states_loss.py                     # GPU: GPT-2 small, 300 steps, three settings
    python scripts/bench/states_loss.py --model medium      # GPT-2 medium
    python scripts/bench/states_loss.py --tiny              # CPU smoke run: tiny model, a few steps
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.bench.common import (  # noqa: E402
    add_out_argument,
    emit,
    environment,
    init_single_process_group,
    out_file,
    stdlib_corpus,
    synchronize,
)

# the bf16 section's keys of each setting (bf16.enabled is always on)
SETTINGS: dict[str, dict[str, bool]] = {
    "fp32_states": {},
    "bf16_states": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
    "bf16_states_nosr": {
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
        "stochastic_rounding": False,
    },
}
BASELINE = "fp32_states"
PRINT_EVERY, TAIL = 25, 50


def engine_config(setting: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1_000_000,
        "gradient_clipping": args.clip,
        "bf16": {"enabled": True, **SETTINGS[setting]},
        "zero_optimization": {"stage": 2},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
    }


def model_config(args: argparse.Namespace) -> Any:
    from runtime.models import GPTConfig

    base = GPTConfig.named("tiny" if args.tiny else args.model)
    return GPTConfig(
        n_layer=base.n_layer,
        n_head=base.n_head,
        n_embd=base.n_embd,
        vocab_size=base.vocab_size,
        max_seq_len=max(base.max_seq_len, args.seq_len),
    )


def run_setting(setting: str, args: argparse.Namespace, device: Any, data: Any) -> dict[str, Any]:
    """Build the model from seed 0, train `args.steps` steps on the corpus windows; this setting's record."""
    import torch

    import runtime
    from runtime.models import GPT

    config = model_config(args)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine, *_ = runtime.initialize(
        model=model, model_parameters=model.parameters(), config=engine_config(setting, args)
    )
    rows, width = args.micro_batch, args.seq_len + 1
    losses: list[float] = []
    synchronize(device)
    start = time.perf_counter()
    for i in range(args.steps):
        block = data[i * rows * width : (i + 1) * rows * width].view(rows, width).to(device)
        _, loss = engine(block[:, :-1], block[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if i % PRINT_EVERY == 0 or i == args.steps - 1:
            print(f"{setting} step {i}: loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    synchronize(device)
    seconds = time.perf_counter() - start
    bf16 = engine.config.bf16  # what ran, as the engine resolved the config
    record: dict[str, Any] = {
        "bench": "states_loss",
        "setting": setting,
        "model": "tiny" if args.tiny else args.model,
        "params": config.num_params(),
        "device": str(device),
        "zero_stage": engine.zero_stage,
        "optimizer": "AdamW",
        "lr": args.lr,
        "clip": args.clip,
        "bf16_masters": bf16.bf16_master_weights_and_grads,
        "bf16_states": bf16.bf16_optimizer_states,
        "stochastic_rounding": bf16.bf16_master_weights_and_grads and bf16.stochastic_rounding,
        "steps": args.steps,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "losses_every_25": {
            str(i): round(v, 5) for i, v in enumerate(losses) if i % PRINT_EVERY == 0 or i == len(losses) - 1
        },
        "loss_first": round(losses[0], 5),
        "final_loss": round(losses[-1], 5),
        f"last{TAIL}_mean": round(statistics.fmean(losses[-TAIL:]), 5),
        "tokens_per_s": round(rows * args.seq_len * args.steps / seconds, 1),
        "wall_s": round(seconds, 1),
    }
    if device.type == "cuda":
        record["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    engine.destroy()
    del engine, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", choices=("small", "medium"))
    parser.add_argument(
        "--tiny", action="store_true", help="CPU smoke run: the tiny model, seq 32, <= 8 steps"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--micro_batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (0 = off)")
    parser.add_argument(
        "--settings", default=",".join(SETTINGS), help=f"comma-separated, from {', '.join(SETTINGS)}"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda where torch sees one")
    add_out_argument(parser, "states-loss")
    args = parser.parse_args(argv)
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown or not args.settings:
        parser.error(f"unknown --settings {unknown}; choose from {', '.join(SETTINGS)}")
    args.settings.sort(key=lambda s: s != BASELINE)  # the baseline first, so each later row has its ratio
    if args.tiny:
        args.device = "cpu"
        args.seq_len, args.micro_batch, args.steps = (
            min(args.seq_len, 32),
            min(args.micro_batch, 2),
            min(args.steps, 8),
        )
    if min(args.steps, args.seq_len, args.micro_batch) <= 0:
        parser.error("--steps, --seq_len and --micro_batch must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import os

    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    os.environ["DS_ACCELERATOR"] = device.type  # our engine picks its device from it
    init_single_process_group(device)
    need = args.micro_batch * (args.seq_len + 1) * args.steps
    corpus = stdlib_corpus(need)
    if len(corpus) < need:
        print(f"the stdlib corpus has {len(corpus)} bytes, {need} needed: fewer --steps", file=sys.stderr)
        return 2
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
    out = out_file(args.out, "states-loss")
    emit({"bench": "states_loss", "setting": "start", **environment(args.device), "corpus_bytes": need}, out)
    records = {}
    for setting in args.settings:
        records[setting] = record = run_setting(setting, args, device, data)
        base = records.get(BASELINE)
        key = f"last{TAIL}_mean"
        record["rel_to_fp32_states"] = None if base is None else round(record[key] / base[key] - 1, 5)
        emit(record, out)
    summary: dict[str, Any] = {
        "bench": "states_loss",
        "setting": "summary",
        "baseline": BASELINE,
        "goal": 0.01,
    }
    for setting, record in records.items():
        summary[f"{setting}_last{TAIL}_mean"] = record[f"last{TAIL}_mean"]
        summary[f"{setting}_rel_to_fp32_states"] = record["rel_to_fp32_states"]
        rel = record["rel_to_fp32_states"]
        gap = "" if rel is None else f" ({rel:+.2%} against {BASELINE})"
        print(
            f"{setting}: mean of the last {TAIL} losses {record[f'last{TAIL}_mean']:.4f}{gap}",
            file=sys.stderr,
        )
    emit(summary, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
