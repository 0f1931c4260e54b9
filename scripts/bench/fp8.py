"""FP8 against bf16 training (issue 33 item 2): a compiled engine each way, one process, ZeRO 2, world 1.

The model is a Llama-shaped ``LlamaForCausalLM`` built from a ``LlamaConfig`` in this script (no hub): by
default about 2.9B parameters (hidden 3072, MLP 8192, 28 layers, 24 heads of which 8 key/value, vocab
32000, tied head: Llama-3.2-3B's body with a smaller vocabulary). Both settings train it with bf16
weights, fp32 masters, AdamW(lr 3e-4, weight decay 0.01), clipping at 1.0, ZeRO stage 2, and
``engine.compile()``. --settings names what runs, in order, each in a fresh engine: ``bf16``; ``fp8`` adds
``"fp8": {"enabled": true, "recipe": --recipe}``, which converts the attention and MLP projections
(runtime/fp8.py's rule, logged at start: the tied head stays bf16; the key and value projections,
3072 -> 1024, below float8's break-even alone, convert beside the query projection, which reads their
input: before 2026-12-08 they stayed bf16); ``fp8-all`` turns the break-even filter off
(``auto_filter_small_kn`` false: the same layers on this model, since the exception converts them).
Either fp8 setting takes a recipe after ``@`` (``fp8@rowwise_with_gw_hp``; without one, --recipe's), so
recipes compare in one run.

Throughput: for each setting, a fresh engine, --warmup steps (compilation), then --repeats timed blocks of
--steps steps each on one fixed batch of random tokens; tokens/s of each block, and the median, min and
max over blocks. MFU counts 6·N + 12·L·d·T FLOPs a token (N: the parameters of every linear layer, the
head included) against the device's bf16 dense peak, for both settings (fp8's own peak is twice that).
The settings run one after the other (two engines at once do not fit beside each other's state); each
row is printed as its setting ends, and every fp8 row's ratio to the bf16 row at the end.

--loss_steps N: instead, train each setting N steps from the same initial weights on the same batches of
a real corpus: the Python standard library's own sources (every ``*.py`` under ``sysconfig``'s stdlib
path, tests and site-packages left out, sorted by path), tokenized bytewise (token = byte, ids 0-255), in
consecutive windows of --seq_len bytes (labels = inputs; the model shifts them). The lr follows the
config's WarmupCosineLR, as a real run's would: linear from 0 to 3e-4 over --lr_warmup steps, then a cosine
down to a tenth at step N (--lr_warmup 0: a constant 3e-4, as the runs before 2026-12-07). The row gives
the loss every 25 steps and the mean of the last 50; issue 33's goal is fp8's within 1% of bf16's.

--profile adds `compute_profile` to each throughput row: one forward+backward's GPU milliseconds in float8
matmuls, the other matmuls, attention, Triton kernels (inductor's fused code: float8's casts and scales)
and the rest, and the top kernels: what keeps fp8's forward and backward from being shorter still.

--seeds runs every setting from each seed's initial weights in turn and ends with the median, min and max
over seeds of each fp8 setting's difference to bf16 (a later seed recompiles from inductor's cache).

    python scripts/bench/fp8.py --repeats 3                      # H200: ~3B model, bf16 then fp8
    python scripts/bench/fp8.py --settings bf16,fp8,fp8-all      # the break-even rule's A/B
    python scripts/bench/fp8.py --loss_steps 300 --settings bf16,fp8,fp8@rowwise_with_gw_hp   # two recipes
    python scripts/bench/fp8.py --loss_steps 300                 # the loss curves on the stdlib corpus
    python scripts/bench/fp8.py --loss_steps 300 --seeds 0,1,2   # from three initial weights: a spread
    python scripts/bench/fp8.py --tiny                           # CPU smoke run: a tiny model, eager backend

Output: one JSON line per setting (``"bench": "fp8"``), stamped with the commit and machine (common.py);
--out FILE appends them to FILE as well.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runtime.config.fp8 import RECIPES  # noqa: E402
from scripts.bench.common import (  # noqa: E402
    add_out_argument,
    emit,
    mfu,
    out_file,
    stdlib_corpus,
    synchronize,
)
from scripts.bench.profiling import phases, profile_compute  # noqa: E402

SHAPES = {
    "3b": {
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
    },
}


def build_model(shape: dict[str, int], seq_len: int, seed: int, device: Any) -> Any:
    """The Llama of `shape`, its weights drawn from `seed` on `device` (drawing the 3B's on a CPU is slow)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        **shape, max_position_embeddings=seq_len, tie_word_embeddings=True, attn_implementation="sdpa"
    )
    with torch.device(device):
        return LlamaForCausalLM(config)


SETTINGS = ("bf16", "fp8", "fp8-all")


def split_setting(setting: str, default_recipe: str) -> tuple[str, str | None]:
    """("fp8-all", "rowwise") of "fp8-all@rowwise": the setting's kind and its recipe (None for bf16)."""
    kind, _, recipe = setting.partition("@")
    return kind, None if kind == "bf16" else recipe or default_recipe


def engine_config(setting: str, args: argparse.Namespace) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 0,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 2},
    }
    if args.loss_steps and args.lr_warmup:
        cfg["scheduler"] = {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": args.loss_steps,
                "warmup_num_steps": args.lr_warmup,
                "warmup_type": "linear",
                "warmup_min_ratio": 0.0,
                "cos_min_ratio": 0.1,
            },
        }
    kind, recipe = split_setting(setting, args.recipe)
    if recipe is not None:
        cfg["fp8"] = {"enabled": True, "recipe": recipe}
        if args.tiny:
            cfg["fp8"]["min_features"] = 16  # the tiny model's layers are 64-128 wide
        if args.tiny or kind == "fp8-all":
            cfg["fp8"]["auto_filter_small_kn"] = False
    return cfg


def linear_params(model: Any) -> int:
    from torch import nn

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def run_setting(setting: str, seed: int, args: argparse.Namespace, device: Any, batches: Any) -> dict:
    """Build, compile and train one setting; its measurements. `batches(step)` gives (input, labels)."""
    import torch

    import runtime

    began = time.perf_counter()
    kind, recipe = split_setting(setting, args.recipe)
    shape = SHAPES["tiny" if args.tiny else "3b"]
    model = build_model(shape, args.seq_len, seed, device)
    n_linear = linear_params(model)
    engine, _, _, _ = runtime.initialize(model=model, config=engine_config(setting, args))
    engine.compile(backend="eager" if device.type == "cpu" else None)

    def compute(i: int) -> torch.Tensor:
        x, y = batches(i)
        loss = engine(input_ids=x, labels=y).loss
        engine.backward(loss)
        return loss.detach()

    def step(i: int) -> torch.Tensor:
        loss = compute(i)
        engine.step()
        return loss

    record: dict[str, Any] = {
        "bench": "fp8",
        "setting": setting,
        "recipe": recipe,
        "auto_filter_small_kn": None if recipe is None else not (args.tiny or kind == "fp8-all"),
        "seed": seed,
        "linear_params": n_linear,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "device": str(device),
    }
    if args.loss_steps:
        losses = [float(step(i)) for i in range(args.loss_steps)]
        every25 = {i: round(losses[i], 4) for i in range(0, len(losses), 25)}
        for i, loss in every25.items():
            print(f"{setting} step {i}: loss {loss:.4f}", file=sys.stderr)
        record.update(
            loss_steps=args.loss_steps,
            lr_warmup=args.lr_warmup,
            loss_every_25=every25,
            last50_mean=statistics.fmean(losses[-50:]),
            final_loss=losses[-1],
        )
    else:
        from runtime.compile import compile_counts

        before = compile_counts()
        for i in range(args.warmup):
            step(i)
        # what the warm-up compiled (dynamo's counters are the process's: the difference)
        record.update({key: value - before[key] for key, value in compile_counts().items()})
        tokens = args.micro_batch * args.seq_len * args.steps
        rates = []
        for _ in range(args.repeats):
            synchronize(device)
            start = time.perf_counter()
            for i in range(args.steps):
                step(i)
            synchronize(device)
            rates.append(tokens / (time.perf_counter() - start))
        layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
        flops_per_token = 6 * n_linear + 12 * layers * hidden * args.seq_len
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        med = statistics.median(rates)
        record.update(
            repeats=args.repeats,
            steps=args.steps,
            tokens_per_s_median=round(med, 1),
            tokens_per_s_min=round(min(rates), 1),
            tokens_per_s_max=round(max(rates), 1),
            mfu_bf16_peak=mfu(med * flops_per_token, name),
        )
        if device.type == "cuda":
            record.update(phases(lambda: compute(0), engine.step, args.steps, []))
            record["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if args.profile:
            record["compute_profile"] = profile_compute(lambda: compute(0), engine.step, device)
    record["wall_s"] = round(time.perf_counter() - began, 1)  # build, compile and train: what a call budgets
    engine.destroy()
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (smoke run)")
    parser.add_argument("--recipe", default="tensorwise", choices=RECIPES)
    parser.add_argument(
        "--settings",
        default="bf16,fp8",
        help=f"comma-separated, of {', '.join(SETTINGS)} (fp8-all: the key and value projections in float8 "
        "too; an fp8 setting may end in @RECIPE); bf16 first: the fp8 rows' ratios are to it",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--micro_batch", type=int, default=2)
    parser.add_argument("--loss_steps", type=int, default=0, help="train N steps on the corpus instead")
    parser.add_argument(
        "--lr_warmup", type=int, default=30, help="--loss_steps: lr warmup steps (0: constant)"
    )
    parser.add_argument(
        "--seeds",
        default="0",
        help="comma-separated seeds of the initial weights (every setting starts from the same weights): "
        "with --loss_steps, a spread over seeds tells a 1%% difference from one run's noise",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="each setting's forward+backward under torch.profiler too (compute_profile: GPU milliseconds "
        "in float8 and other matmuls, attention, Triton kernels, and the top kernels)",
    )
    add_out_argument(parser, "fp8")
    args = parser.parse_args(argv)
    settings = args.settings.split(",")
    seeds = (
        [int(seed) for seed in args.seeds.split(",")] if args.loss_steps else [int(args.seeds.split(",")[0])]
    )
    parts = [split_setting(setting, args.recipe) for setting in settings]
    if (
        any(kind not in SETTINGS or (recipe or args.recipe) not in RECIPES for kind, recipe in parts)
        or settings[0] != "bf16"
        or len(set(parts)) != len(parts)
    ):
        parser.error(
            f"--settings: bf16 first, then any of {', '.join(SETTINGS[1:])} (each may end in @RECIPE, of "
            f"{', '.join(RECIPES)}), each once; got {args.settings}"
        )
    if args.tiny:
        args.seq_len, args.micro_batch = min(args.seq_len, 64), min(args.micro_batch, 2)
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)

    import torch

    from scripts.bench.common import init_single_process_group

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda:0")
    init_single_process_group(device)
    rows, width = args.micro_batch, args.seq_len  # the model shifts labels itself
    if args.loss_steps:
        corpus = stdlib_corpus(rows * width * args.loss_steps)
        data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
        if data.numel() < rows * width * args.loss_steps:
            parser.error(f"the stdlib corpus has {data.numel()} bytes; fewer --loss_steps or --seq_len")
        print(f"corpus: {data.numel()} bytes of {sysconfig.get_paths()['stdlib']}/**/*.py", file=sys.stderr)

        def batches(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            block = data[i * rows * width : (i + 1) * rows * width].view(rows, width).to(device)
            return block, block
    else:
        vocab = SHAPES["tiny" if args.tiny else "3b"]["vocab_size"]
        fixed = torch.randint(0, vocab, (rows, args.seq_len), generator=torch.Generator().manual_seed(0))
        fixed = fixed.to(device)

        def batches(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return fixed, fixed

    from scripts.bench.compiled import release  # collects, drops dynamo's graphs, empties CUDA's cache

    out = out_file(args.out, "fp8")
    results: dict[tuple[int, str], dict] = {}
    for seed in seeds:
        for setting in settings:
            results[seed, setting] = run_setting(setting, seed, args, device, batches)
            # once the setting's frame is gone: a cycle through its closures and the engine can outlive it
            # and keep the 3B's 50 GiB while the next setting builds
            release(device)
            emit(results[seed, setting], out)  # now: a later setting may not finish in the time a command has
    key = "last50_mean" if args.loss_steps else "tokens_per_s_median"
    for setting in settings[1:]:
        ratios = [results[seed, setting][key] / results[seed, "bf16"][key] for seed in seeds]
        spread = f"median {statistics.median(ratios):.4f}, min {min(ratios):.4f}, max {max(ratios):.4f}"
        if args.loss_steps:
            print(f"{setting} loss / bf16's over seeds {args.seeds}: {spread}", file=sys.stderr)
        else:
            print(f"{setting} tokens/s / bf16's: {ratios[0]:.3f}x", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
