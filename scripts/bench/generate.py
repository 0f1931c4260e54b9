"""Generation under ZeRO-3 (issue 29): a GRPO-style step's `generate()` timed three ways in one process.

Each rank builds GPT-2 medium from GPT2Config (no hub; bf16), wraps it in a ZeRO-3 training engine
(AdamW, bf16, `runtime.initialize`), trains one step on random tokens (so the engine is the one a GRPO
trainer holds between its updates), and then times, on the same prompts (a batch of --batch random
prompts of --prompt_len tokens), greedy `generate()` of --new_tokens tokens (min_new_tokens too, so
every row makes exactly that many):

    plain      an unsharded copy of the model (the engine's weights) on the same device, no engine
    gathered   the engine, TRL's pattern (`unwrap_model_for_generation`): all parameters gathered with
               GatheredParameters, the module hooks removed (TRL's own `remove_hooks` / `add_hooks`
               where trl imports, else the same steps through `engine.parameter_offload`), generate,
               hooks re-added, released; the gather and the release are inside the timed region
    per_layer  the engine with its hooks on and nothing gathered: every forward of every token gathers
               and releases unit by unit (TRL's `ds3_gather_for_generation=False`). --per_layer_tokens
               times fewer tokens when that is too slow (its row says so; per-token figures compare)

The issue's goals: gathered <= 1.1x plain, per_layer >= 10x gathered (per token). With one rank stage 3
keeps every weight whole (nothing to gather: per_layer then equals gathered), so the per-layer row means
something with `--world 2` or more (one process per GPU, NCCL; spawned here, rank 0 reports), or with
`--offload_param` (the shards live in host memory, so every gather uploads its unit; one GPU will do).
Every row also says whether its tokens equal the plain model's.

Output: JSON lines (common.emit: stdout, and --out FILE or a bare --out for
results/<yyyymmdd>_<hw>_generate.jsonl), one per mode, then a summary with the ratios.

    python scripts/bench/generate.py --world 2                     # 2 GPUs: GPT-2 medium, 256 tokens
    python scripts/bench/generate.py --offload_param               # 1 GPU, shards in host memory
    python scripts/bench/generate.py --device cpu --tiny --world 2 # smoke check (gloo)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from scripts.bench.common import add_out_argument, emit, environment, free_port, out_file  # noqa: E402

MEDIUM = {"n_layer": 24, "n_head": 16, "n_embd": 1024, "vocab_size": 50257}
TINY = {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 512}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--world", type=int, default=1, help="ranks (one GPU each on cuda)")
    parser.add_argument("--offload_param", action="store_true",
                        help="ZeRO-3 parameter offload (shards in host memory, optimizer on the CPU): "
                        "one rank then holds no whole weight, and a gather uploads it")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="a 2-layer GPT-2 (the CPU smoke check)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--per_layer_tokens", type=int, default=None, help="tokens for the per_layer row")
    parser.add_argument("--hooks", choices=("auto", "trl", "runtime"), default="auto",
                        help="whose remove_hooks/add_hooks: TRL's (auto: where trl imports) or "
                        "engine.parameter_offload's")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed generate() calls per mode (median)")
    add_out_argument(parser, "generate")
    args = parser.parse_args(argv)
    args.out = out_file(args.out, "generate")
    return args


def build_model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    shape = TINY if args.tiny else MEDIUM
    config = GPT2Config(**shape, n_positions=args.prompt_len + args.new_tokens + 8, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                        pad_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config)


def trl_hooks(choice: str) -> tuple[Any, Any, str]:
    """TRL's own remove_hooks/add_hooks, or the same steps through our names (where trl is not installed,
    or asked for)."""
    try:
        if choice == "runtime":
            raise ImportError("asked for")
        from trl.models.utils import add_hooks, remove_hooks

        return remove_hooks, add_hooks, "trl"
    except ImportError:
        if choice == "trl":
            raise

        def remove(engine: Any) -> None:
            engine.optimizer.parameter_offload.remove_module_hooks()

        def add(engine: Any) -> None:
            offload = engine.optimizer.parameter_offload
            offload.param_coordinator._invalidate_trace()
            offload._register_deepspeed_module(offload.module)

        return remove, add, "runtime"


def timed(fn: Any, device: Any, repeats: int) -> tuple[float, Any]:
    """(median seconds, last result) of `repeats` calls, each between device synchronizations."""
    import statistics

    import torch

    times, result = [], None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def worker(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One rank's run (the process group from the environment, or the one that exists); rank 0 emits the
    rows and the summary and returns them (other ranks return [])."""
    import torch

    import runtime
    from runtime.distributed import current_device
    from runtime.zero import GatheredParameters

    runtime.init_distributed()
    rank = torch.distributed.get_rank()
    device = current_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
        "bf16": {"enabled": dtype == torch.bfloat16},
        # the tiny model's weights all fall under DeepSpeed's default persistence threshold (1e5)
        "zero_optimization": {"stage": 3, **({"stage3_param_persistence_threshold": 0} if args.tiny else {})},
    }
    if args.offload_param:
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
        config["zero_optimization"]["offload_optimizer"] = {
            "device": "cpu",
            "pin_memory": device.type == "cuda",
        }
    engine, *_ = runtime.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    batch = torch.randint(1, vocab, (args.batch, args.prompt_len + 16), generator=gen).to(device)
    engine.backward(engine(batch, labels=batch).loss)  # one GRPO-style update before generating
    engine.step()
    prompts = torch.randint(1, vocab, (args.batch, args.prompt_len), generator=gen).to(device)
    mask = torch.ones_like(prompts)

    plain = build_model(args).to(device=device, dtype=dtype).eval()
    plain.load_state_dict({k: v.to(dtype) for k, v in engine.full_state_dict(rank0_only=False).items()})
    module = engine.module.eval()

    def generate(model: Any, tokens: int) -> Any:
        with torch.no_grad():
            return model.generate(prompts, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                                  do_sample=False, pad_token_id=0)  # fmt: skip

    remove_hooks, add_hooks, pattern = trl_hooks(args.hooks)

    def gathered(tokens: int) -> Any:
        with GatheredParameters(list(module.parameters())):
            remove_hooks(engine)
            out = generate(module, tokens)
            add_hooks(engine)
        return out

    stats = engine.zero.stats if hasattr(engine.zero, "stats") else None
    per_layer_tokens = args.per_layer_tokens or args.new_tokens
    modes = {
        "plain": (lambda: generate(plain, args.new_tokens), args.new_tokens),
        "gathered": (lambda: gathered(args.new_tokens), args.new_tokens),
        "per_layer": (lambda: generate(module, per_layer_tokens), per_layer_tokens),
    }
    rows: dict[str, dict[str, Any]] = {}
    reference = None
    for name, (fn, tokens) in modes.items():
        warm = {"plain": lambda: generate(plain, 4), "gathered": lambda: gathered(4),
                "per_layer": lambda: generate(module, 4)}[name]  # fmt: skip
        warm()
        gathers_before = stats.gathers if stats is not None else 0
        seconds, out = timed(fn, device, args.repeats)
        if name == "plain":
            reference = out
        assert reference is not None
        same = torch.equal(out, reference[:, : out.shape[1]])
        rows[name] = {
            "bench": "generate",
            "mode": name,
            "world": args.world,
            "offload_param": args.offload_param,
            "model": "gpt2-tiny" if args.tiny else "gpt2-medium",
            "dtype": str(dtype).removeprefix("torch."),
            "batch": args.batch,
            "prompt_len": args.prompt_len,
            "new_tokens": tokens,
            "seconds": seconds,
            "per_token_ms": 1000 * seconds / tokens,
            "tokens_per_s": args.batch * tokens / seconds,
            "unit_gathers_per_call": ((stats.gathers - gathers_before) / args.repeats) if stats else None,
            "tokens_match_plain": bool(same),
            "hooks": pattern if name == "gathered" else None,
            "note": None
            if tokens == args.new_tokens
            else f"timed {tokens} new tokens, not {args.new_tokens}",
        }
    # after generating, training goes on: one more step with the hooks back
    loss = engine(batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    if rank != 0:
        return []
    emit({"bench": "generate", "environment": environment(str(device))}, args.out)
    for row in rows.values():
        emit(row, args.out)
    gathered_ms = rows["gathered"]["per_token_ms"]
    summary = {
        "bench": "generate",
        "summary": True,
        "world": args.world,
        "offload_param": args.offload_param,
        "gathered_over_plain": gathered_ms / rows["plain"]["per_token_ms"],
        "per_layer_over_gathered": rows["per_layer"]["per_token_ms"] / gathered_ms,
        "goal_gathered_over_plain_max": 1.1,
        "goal_per_layer_over_gathered_min": 10.0,
        "all_tokens_match": all(r["tokens_match_plain"] for r in rows.values()),
        "loss_after_generation": float(loss.detach()),
    }
    emit(summary, args.out)
    return [*rows.values(), summary]


def _spawned(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.world),
                       "LOCAL_WORLD_SIZE": str(args.world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})  # fmt: skip
    worker(args)
    torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ["DS_ACCELERATOR"] = args.device
    if args.device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "RANK" in os.environ:  # started by a launcher: this process is one rank
        worker(args)
        return 0
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_spawned, args=(rank, args, port)) for rank in range(args.world)]
    for proc in procs:
        proc.start()
    with contextlib.suppress(KeyboardInterrupt):
        for proc in procs:
            proc.join()
    return max((proc.exitcode or 0) for proc in procs)


if __name__ == "__main__":
    sys.exit(main())
