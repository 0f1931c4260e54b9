"""Train a GPT language model with the dslaunch runtime: the example job.

Any launcher that sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT works, or none for a single process:

    dslaunch --num_gpus 2 scripts/train_gpt.py --deepspeed_config scripts/configs/zero2.json --model_size tiny
    torchrun --nproc_per_node 2 scripts/train_gpt.py --deepspeed_config scripts/configs/zero2.json
    python scripts/train_gpt.py --steps 50

By default it trains our GPT (runtime.models) on the corpus shipped in scripts/data with the byte-level
tokenizer, so nothing is downloaded. With `transformers` installed, --model_name_or_path trains a Hugging
Face GPT2LMHeadModel and --tokenizer picks a Hugging Face tokenizer; --config_name DIR_OR_JSON (or
--model_type gpt2, with --config_overrides "n_embd=64,n_layer=2") builds one from a config alone, with random
weights, so the walk-through runs offline; with `datasets` installed, --dataset_name reads a Hugging Face
dataset instead of --train_file.

--pipeline_parallel N trains our GPT as N pipeline stages (engine.train_batch); --tensor_parallel N shards
a Hugging Face GPT-2's projections over N ranks (AutoTP); the rest of the ranks are data parallel
(scripts/train_gpt_parallel.py).

The batch size, precision, ZeRO stage, optimizer and schedule come from the DeepSpeed-style config;
--lr and --micro_batch_size override the config's values. --steps counts optimizer steps. Every
--log_interval steps rank 0 prints that step's loss, averaged over ranks and accumulation micro-steps,
with an ETA (on a terminal also a progress bar), and a summary line at the end. It is the number the
engine's own report (every `steps_per_print` steps) gives for the same step, so the two never disagree.

Errors in the arguments, the config, the data or a checkpoint end the job with one line and a hint and
exit code 2 (runtime.errors); a diverged loss with exit code 1.

Activation checkpointing (every transformer block recomputed in backward) is on with
--deepspeed_activation_checkpointing or when the config has an "activation_checkpointing" section, whose
options (cpu_checkpointing, ...) then apply.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import runtime
from runtime.checkpoint import check_save_dir
from runtime.data import DEFAULT_CORPUS
from runtime.distributed import accelerator
from runtime.models import GPT, MODEL_SIZES
from runtime.monitor import ProgressBar

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, also when imported
from train_gpt_model import UsageError, build_model, build_tokenizer_and_data, check_model_source  # noqa: I001
from train_gpt_parallel import (
    check_parallel_args, has_checkpoint, model_parallel_config,
    replica_loader, check_tensor_parallel_fits,
)  # fmt: skip

# Used when no --deepspeed_config is given: plain data parallelism, fp32, AdamW.
DEFAULT_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 0},
}


class Diverged(Exception):
    """The loss became NaN or infinite: reported as one line and exit code 1."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="train_gpt.py",
        description="Train a GPT language model with the dslaunch runtime.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    runtime.add_config_arguments(parser)
    model = parser.add_argument_group("model")
    model.add_argument("--model_size", default="tiny", help=f"one of: {', '.join(MODEL_SIZES)}")
    model.add_argument("--n_layer", type=int, help="override the size's number of blocks")
    model.add_argument("--n_head", type=int, help="override the size's number of attention heads")
    model.add_argument("--n_embd", type=int, help="override the size's hidden width")
    model.add_argument("--dropout", type=float, default=0.0)
    model.add_argument(
        "--model_name_or_path",
        help="a Hugging Face GPT2LMHeadModel name or local path (needs transformers) instead of our GPT",
    )
    model.add_argument("--config_name", help="a Hugging Face GPT-2 from this config.json (or its folder)")
    model.add_argument("--model_type", help="gpt2: a Hugging Face GPT-2 from its default config")
    model.add_argument("--config_overrides", help='with --config_name/--model_type: "n_embd=64,n_layer=2"')
    model.add_argument("--pipeline_parallel", type=int, default=1, help="pipeline stages (built-in GPT)")
    model.add_argument("--tensor_parallel", type=int, default=1, help="AutoTP degree (Hugging Face GPT-2)")
    data = parser.add_argument_group("data")
    data.add_argument("--train_file", type=Path, default=DEFAULT_CORPUS, help="UTF-8 text to train on")
    data.add_argument(
        "--tokenizer", help="Hugging Face tokenizer name or path (default: bytes, or the model's own)"
    )
    data.add_argument(
        "--dataset_name", help="a Hugging Face dataset instead of --train_file (needs datasets)"
    )
    data.add_argument("--dataset_config_name", help="the dataset's configuration, e.g. wikitext-2-raw-v1")
    data.add_argument("--seq_len", type=int, default=128, help="tokens per training sequence")
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=100, help="optimizer steps to run")
    train.add_argument("--lr", type=float, help="override the config's optimizer learning rate")
    train.add_argument("--micro_batch_size", type=int, help="override train_micro_batch_size_per_gpu")
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--log_interval", type=int, default=10, help="print every N optimizer steps")
    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument("--save_dir", type=check_save_dir, help="checkpoint folder (checked at start)")
    ckpt.add_argument("--save_interval", type=int, default=0, help="save every N steps and at the end")
    ckpt.add_argument("--resume", action="store_true", help="continue from the newest checkpoint there")
    ckpt.add_argument(
        "--die_at_step",
        type=int,
        default=0,
        help="restart tests: rank 0 SIGKILLs itself after step N on the first attempt (DSLAUNCH_ATTEMPT=0)",
    )
    args = parser.parse_args(argv)
    if (args.save_interval or args.resume) and args.save_dir is None:
        parser.error("--save_interval and --resume need --save_dir")
    for name in ("steps", "seq_len", "log_interval"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    if args.micro_batch_size is not None and args.micro_batch_size <= 0:
        parser.error(f"--micro_batch_size must be positive, got {args.micro_batch_size}")
    if args.model_name_or_path and (args.config_name or args.model_type):
        parser.error("--model_name_or_path loads weights; --config_name / --model_type build random ones")
    return args


def build_config(args: argparse.Namespace) -> str | dict[str, Any]:
    """The config to hand to runtime.initialize: the file as given, or a dict when overrides apply."""
    source = getattr(args, "deepspeed_config", None)
    if source is None:
        config = copy.deepcopy(DEFAULT_CONFIG)
    elif args.lr is None and args.micro_batch_size is None:
        return source
    else:
        from runtime.config import read_config_file

        config = read_config_file(source)
    if args.lr is not None:
        optimizer = config.get("optimizer")
        if not isinstance(optimizer, dict):
            raise UsageError(f"--lr needs an 'optimizer' section in {source}")
        optimizer.setdefault("params", {})["lr"] = args.lr
        # Schedules that carry their own peak rate would otherwise ignore the override.
        scheduler_params = (config.get("scheduler") or {}).get("params") or {}
        for key in ("warmup_max_lr", "cycle_max_lr"):
            if key in scheduler_params:
                scheduler_params[key] = args.lr
    if args.micro_batch_size is not None:
        # Keep accumulation as configured and let the runtime derive train_batch_size.
        config["train_micro_batch_size_per_gpu"] = args.micro_batch_size
        if "gradient_accumulation_steps" in config:
            config.pop("train_batch_size", None)
    return config


def wants_activation_checkpointing(args: argparse.Namespace, config: str | dict[str, Any]) -> bool:
    if getattr(args, "deepspeed_activation_checkpointing", False):
        return True
    if isinstance(config, dict):
        return "activation_checkpointing" in config
    from runtime.config import read_config_file

    return "activation_checkpointing" in read_config_file(config)


def enable_activation_checkpointing(model: nn.Module) -> str:
    """Recompute every transformer block in backward; returns how, for the start-up line."""
    if isinstance(model, GPT):
        model.checkpoint_fn = runtime.activation_checkpointing.checkpoint
        return f"activation checkpointing: each of the {len(model.blocks)} blocks"
    # A Hugging Face model checkpoints its own blocks (torch's non-reentrant checkpoint, not our options).
    model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return "activation checkpointing: the Hugging Face model's own (gradient_checkpointing_enable)"


def limit_cpu_threads() -> None:
    """Give each CPU worker its share of the cores, unless the user chose (OMP_NUM_THREADS). A worker
    trains on the CPU where DS_ACCELERATOR=cpu says so, also on a machine with GPUs."""
    if accelerator() == "cuda" or "OMP_NUM_THREADS" in os.environ:
        return
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def endless(loader: Any, micro_batch: int) -> Iterator[Any]:
    """Full micro-batches from the loader, epoch after epoch (reshuffled when the sampler supports it).

    The short batch at the end of an epoch is skipped, so every step trains on the same number of tokens
    and every rank's loss carries the same weight in the average.
    """
    sampler = getattr(loader, "sampler", None)
    epoch = getattr(sampler, "epoch", 0)  # a resumed loader continues its epoch
    while True:
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        resumed_mid_epoch = getattr(sampler, "start_index", 0) > 0
        produced = False
        for batch in loader:
            if len(batch[0]) == micro_batch:
                produced = True
                yield batch
        if not produced and not resumed_mid_epoch:
            raise UsageError(
                f"the dataset gives this rank fewer than one micro-batch ({micro_batch} sequences); use a "
                "longer text, a smaller --seq_len or a smaller micro batch"
            )
        epoch += 1


def mean_over_ranks(value: torch.Tensor) -> float:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


def train(args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(args.seed)
    limit_cpu_threads()
    check_parallel_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    pipeline = args.pipeline_parallel > 1
    model_parallel = pipeline or args.tensor_parallel > 1
    if args.model_name_or_path:
        check_model_source(args.model_name_or_path, with_tokenizer=args.tokenizer is None)
    tokenizer, dataset = build_tokenizer_and_data(args)
    if pipeline:
        runtime.init_distributed()  # a PipelineModule builds only its stage's layers: it needs the ranks
    model = build_model(args, tokenizer.vocab_size)
    check_tensor_parallel_fits(model, args.tensor_parallel)
    config = build_config(args)
    if model_parallel:
        config = model_parallel_config(config, args)
    checkpointing_note = None
    if wants_activation_checkpointing(args, config):
        if pipeline:
            raise UsageError("activation checkpointing with --pipeline_parallel: not in train_gpt.py yet")
        checkpointing_note = enable_activation_checkpointing(model)

    runtime.init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    engine, _, loader, _ = runtime.initialize(
        model=model,
        model_parameters=model.parameters(),
        training_data=None if model_parallel else dataset,
        config=config,
    )
    if model_parallel:  # every rank of a data-parallel replica reads that replica's batches
        loader = engine.training_dataloader = replica_loader(
            dataset, engine.train_micro_batch_size_per_gpu(), engine.grid
        )
    accumulation = engine.gradient_accumulation_steps()
    tokens_per_step = engine.train_batch_size() * args.seq_len
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        replicas = engine.grid.get_data_parallel_world_size() if model_parallel else world
        print(
            f"train_gpt: {n_params / 1e6:.2f}M params{' on rank 0' if model_parallel else ''}, "
            f"{len(dataset)} sequences of {args.seq_len} tokens from {dataset.source}, {world} rank(s) on "
            f"{engine.device}, global batch {engine.train_batch_size()} "
            f"({engine.train_micro_batch_size_per_gpu()} x {accumulation} accumulation x {replicas} "
            f"data-parallel ranks; pipeline {args.pipeline_parallel}, tensor {args.tensor_parallel})",
            flush=True,
        )
        if checkpointing_note:
            print(f"train_gpt: {checkpointing_note}", flush=True)

    first_step = 1
    if args.resume and has_checkpoint(args.save_dir):
        path, _ = engine.load_checkpoint(args.save_dir)
        first_step = engine.global_steps + 1
        if rank == 0:
            print(f"train_gpt: resumed from {path} at step {engine.global_steps}", flush=True)
    batches = endless(loader, engine.train_micro_batch_size_per_gpu())
    progress = ProgressBar(args.steps, enabled=rank == 0)
    last_loss = ""
    losses: list[tuple[int, float]] = []
    # this step's loss summed over micro-steps, in float64 like the engine's report
    step_loss = torch.zeros((), dtype=torch.float64, device=engine.device)
    start = last_log = time.perf_counter()
    last_log_step = first_step - 1
    for step in range(first_step, args.steps + 1):
        step_loss.zero_()
        if pipeline:  # one global batch: its micro-batches flow through the stages; the mean loss back
            step_loss += engine.train_batch(batches).double() * accumulation
        for _ in range(0 if pipeline else accumulation):
            idx, targets = (t.to(engine.device, non_blocking=True) for t in next(batches))
            _, loss = engine(idx, targets)
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().double()
        progress.update(step, last_loss)
        if step == 1 or step % args.log_interval == 0 or step == args.steps:
            mean_loss = mean_over_ranks(step_loss / accumulation)  # this step's, like the engine's report
            now = time.perf_counter()
            tokens_per_s = tokens_per_step * (step - last_log_step) / (now - last_log)
            last_log, last_log_step = now, step
            losses.append((step, mean_loss))
            last_loss = f"loss {mean_loss:.4f}"
            if rank == 0:
                lr = engine.get_lr()
                lr = lr[0] if isinstance(lr, (list, tuple)) else lr
                progress.write(
                    f"step {step}/{args.steps} | loss {mean_loss:.4f} | lr {lr:.3e} | "
                    f"{tokens_per_s:,.0f} tokens/s | {progress.eta()}"
                )
            if not math.isfinite(mean_loss):
                raise Diverged(
                    f"the loss is {mean_loss} at step {step}; try a lower --lr or gradient_clipping"
                )
        if args.save_interval and (step % args.save_interval == 0 or step == args.steps):
            path = engine.save_checkpoint(args.save_dir)
            if rank == 0:
                print(f"train_gpt: saved checkpoint {path}", flush=True)
        if step == args.die_at_step and rank == 0 and os.environ.get("DSLAUNCH_ATTEMPT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
    progress.close()
    if not losses:
        if rank == 0:
            print(f"train_gpt: nothing to do, the checkpoint is at step {first_step - 1}", flush=True)
        return {}
    elapsed = time.perf_counter() - start
    summary = {"first_loss": losses[0][1], "final_loss": losses[-1][1], "seconds": elapsed}
    if rank == 0:
        print(
            f"train_gpt: done, {args.steps} steps in {elapsed:.1f} s, loss {summary['first_loss']:.4f} -> "
            f"{summary['final_loss']:.4f}",
            flush=True,
        )
    return summary


def main(argv: list[str] | None = None) -> int:
    """Train; 0 when done, 1 when the loss diverged. Errors in the user's input (UserError: arguments,
    config, data, checkpoints) propagate, and the runtime's excepthook reports them in one line with a
    hint and exit code 2 (through dslaunch's error file when launched by it)."""
    args = parse_args(argv)
    try:
        train(args)
    except Diverged as exc:
        print(f"train_gpt.py: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
