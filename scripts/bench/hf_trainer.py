"""Hugging Face Trainer throughput: the same unmodified Trainer script without DeepSpeed, on dslaunch's
`deepspeed` compat command with Hugging Face's ZeRO-2 and ZeRO-3 configs, and with Trainer's own FSDP.

The workload is GPT-2 medium built from GPT2Config (no hub; n_positions 1024), sequences of 1024 random
tokens made here, bf16, AdamW, a fixed per-device batch; --warmup steps, then --steps timed steps.
Each configuration is launched the way its users launch it, in its own subprocess with a timeout:

    plain     python hf_trainer.py --worker ...              (torchrun --nproc_per_node N when N > 1)
    ds-zero2  deepspeed --num_gpus N hf_trainer.py --worker --deepspeed zero2.json
    ds-zero3  deepspeed --num_gpus N hf_trainer.py --worker --deepspeed zero3.json
    fsdp      torchrun --nproc_per_node N hf_trainer.py --worker --fsdp      (fsdp="full_shard auto_wrap")

The DeepSpeed configs are the Hugging Face documentation's ZeRO-2 / ZeRO-3 configs with their "auto"
values, without the offload sections (a GPU throughput comparison) and without the scheduler section
(the Trainer builds its own). The worker times the steps with a TrainerCallback: a device synchronize and
a clock reading at each step's begin and end; tokens/s is the timed steps' tokens over the wall time from
the first timed step's begin to the last one's end (what the Trainer does between steps is included).

Output: one JSON line per configuration on stdout (also appended to --out FILE, or with a bare --out to
results/<yyyymmdd>_<hw>_hf-trainer.jsonl), each stamped with the commit, date, machine and command
(common.py), a failing or timed-out one with "error", then a summary line with every configuration's
ratio to `plain` from the same run. Each configuration gets --timeout seconds (its whole process group
is stopped after that), all of them together --budget seconds. On CPU (the smoke check) training is
fp32 and `fsdp` is skipped with its reason: the Trainer does not apply FSDP there.

    python scripts/bench/hf_trainer.py                                     # H200: about 4 minutes
    DS_ACCELERATOR=cpu python scripts/bench/hf_trainer.py --device cpu --tiny   # smoke check, no GPU
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from scripts.bench.common import add_out_argument, emit, free_port, out_file, run_isolated  # noqa: E402

CONFIGS = ("plain", "ds-zero2", "ds-zero3", "fsdp")
SEQ_LEN = 1024
# --tiny, the CPU smoke check: a 2-layer GPT-2 on 64 tokens
TINY = {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 512, "bos_token_id": 0, "eos_token_id": 0}
SEQ_LEN_TINY = 64

# Hugging Face's documented ZeRO configs ("auto" filled in by the Trainer), offload and scheduler left out.
ZERO_COMMON: dict[str, Any] = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}  # fmt: skip
ZERO2 = {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
         "reduce_scatter": True, "reduce_bucket_size": "auto", "contiguous_gradients": True}  # fmt: skip
ZERO3 = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
         "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
         "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
         "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}  # fmt: skip
# Checked with transformers 5.25 / accelerate 1.16: with use_cpu the Accelerator is MULTI_CPU, has no
# fsdp_plugin, and the Trainer trains the model under DDP while the arguments still say fsdp.
CPU_FSDP_SKIP = (
    "not run on CPU: the Trainer does not apply FSDP there (Accelerate's CPU mode has no FSDP plugin; the "
    "model would train under DDP while labelled fsdp)"
)


# ---------------------------------------------------------------------------------------------- driver


def deepspeed_command() -> list[str]:
    """The compat `deepspeed` console script beside this Python (or on PATH); without an installed
    compat distribution, the same entry point run through this Python (PYTHONPATH has compat/)."""
    beside = Path(sys.executable).parent / "deepspeed"
    found = str(beside) if beside.exists() else shutil.which("deepspeed")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from deepspeed.launcher.runner import main; sys.exit(main())"]


def launch_command(config: str, args: argparse.Namespace, workdir: Path) -> list[str]:
    """The command line a user would type for this configuration."""
    worker = [str(Path(__file__).resolve()), "--worker", "--result", str(workdir / f"{config}.json"),
              "--output_dir", str(workdir / config), *worker_flags(args)]  # fmt: skip
    port = ["--master_port", str(free_port())]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.num_gpus), *port]
    if config == "plain":
        return [sys.executable, *worker] if args.num_gpus == 1 else [*torchrun, *worker]
    if config == "fsdp":
        return [*torchrun, *worker, "--fsdp"]
    zero = ZERO2 if config == "ds-zero2" else ZERO3
    ds_config = workdir / f"{config}_config.json"
    ds_config.write_text(json.dumps({**ZERO_COMMON, "zero_optimization": zero}, indent=2))
    return [*deepspeed_command(), "--num_gpus", str(args.num_gpus), *port, *worker, "--deepspeed",
            str(ds_config)]  # fmt: skip


def worker_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--batch", str(args.batch), "--warmup", str(args.warmup), "--steps", str(args.steps),
             "--device", args.device]  # fmt: skip
    return flags + (["--tiny"] if args.tiny else [])


def compat_metadata(workdir: Path) -> list[str]:
    """Where `pip install -e ./compat` was not run: a directory holding the distribution's metadata alone,
    for PYTHONPATH. Accelerate (and older Transformers) call `deepspeed` available only when
    importlib.metadata finds the distribution, not merely the package."""
    try:
        importlib.metadata.version("deepspeed")
        return []
    except importlib.metadata.PackageNotFoundError:
        pass
    pyproject = (REPO / "compat" / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE).group(1)  # tomllib is 3.11+
    info = workdir / "compat_metadata" / f"deepspeed-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n")
    return [str(info.parent)]


def worker_env(device: str, workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    # our runtime and the compat `deepspeed` package importable from this checkout, ahead of anything else
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "compat"), *compat_metadata(workdir), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if device == "cpu":  # Trainer and Accelerate pick a GPU whenever they see one
        env.update({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    return env


def run_config(config: str, args: argparse.Namespace, workdir: Path, timeout: float) -> dict[str, Any]:
    record: dict[str, Any] = {"bench": "hf_trainer", "config": config, "num_gpus": args.num_gpus}
    if config == "fsdp" and args.device == "cpu":
        record["skipped"] = CPU_FSDP_SKIP
        return record
    command = launch_command(config, args, workdir)
    record["command"] = shlex.join(command)
    if timeout <= 0:
        record["error"] = f"not run: the --budget of {args.budget} s was spent by the configurations before"
        return record
    # its own session, so a timeout stops the launcher's workers too, not only the launcher
    env = worker_env(args.device, workdir)
    done = run_isolated(command, timeout, cwd=workdir, env=env, merge_stderr=True)
    if done.timed_out:
        record["error"] = f"timed out after {round(timeout, 1)} s; output tail: {done.stdout[-1500:]}"
        return record
    record["wall_s"] = round(done.wall_s, 1)
    result = workdir / f"{config}.json"
    if done.returncode != 0 or not result.exists():
        record["error"] = f"exit code {done.returncode}; output tail: {done.stdout[-3000:]}"
        return record
    record.update(json.loads(result.read_text()))
    return record


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    speeds = {r["config"]: r["tokens_per_s"] for r in records if r.get("tokens_per_s")}
    base = speeds.get("plain")
    ratios = {c: (round(v / base, 4) if base else None) for c, v in speeds.items()}
    failed = [r["config"] for r in records if "error" in r]
    return {"bench": "hf_trainer", "event": "summary", "tokens_per_s": speeds, "ratio_to_plain": ratios,
            "failed": failed, "skipped": [r["config"] for r in records if "skipped" in r]}  # fmt: skip


def drive(args: argparse.Namespace) -> int:
    records = []
    deadline = time.monotonic() + args.budget  # the whole run's, so a slow configuration cannot eat the call
    with tempfile.TemporaryDirectory(prefix="hf_trainer_bench_") as tmp:
        for config in args.configs:
            record = run_config(config, args, Path(tmp), min(args.timeout, deadline - time.monotonic()))
            emit(record, args.out)
            records.append(record)
    emit(summary(records), args.out)
    return 0 if all("error" not in r for r in records) else 1


# ---------------------------------------------------------------------------------------------- worker


def run_worker(args: argparse.Namespace) -> None:
    """The Trainer script itself, as a user would write it; rank 0 writes its timings to --result."""
    import torch
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    seq = SEQ_LEN_TINY if args.tiny else SEQ_LEN
    medium = {"n_embd": 1024, "n_layer": 24, "n_head": 16}  # GPT2Config()'s defaults are GPT-2 small
    config = GPT2Config(n_positions=seq, **(TINY if args.tiny else medium))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    total_steps = args.warmup + args.steps

    class RandomTokens(Dataset):
        def __init__(self, rows: int) -> None:
            gen = torch.Generator().manual_seed(1234)
            self.rows = torch.randint(0, config.vocab_size, (rows, seq), generator=gen)

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.rows[i], "labels": self.rows[i]}

    class StepClock(TrainerCallback):
        """Device-synchronized clock readings at every optimizer step's begin and end."""

        def __init__(self) -> None:
            self.begins: list[float] = []
            self.ends: list[float] = []

        def _now(self) -> float:
            if torch.cuda.is_available() and args.device != "cpu":
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_step_begin(self, targs, state, control, **kwargs):
            self.begins.append(self._now())

        def on_step_end(self, targs, state, control, **kwargs):
            self.ends.append(self._now())

    on_cpu = args.device == "cpu"
    training = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        max_steps=total_steps,
        learning_rate=1e-4,
        weight_decay=0.01,
        # optim: the Trainer's default (torch's fused AdamW on torch >= 2.8); ds-* use the config's AdamW
        bf16=not on_cpu,  # the CPU smoke check trains fp32: Transformers refuses bf16 on CPU with DeepSpeed
        logging_steps=total_steps,  # one log line at the end, no per-step host sync from logging
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        deepspeed=args.deepspeed,
        # Plain and FSDP runs on a CPU-only machine need Accelerate's CPU mode; DeepSpeed runs take the
        # device from DS_ACCELERATOR and must not set it.
        use_cpu=on_cpu and args.deepspeed is None,
        fsdp="full_shard auto_wrap" if args.fsdp else "",
        fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"]} if args.fsdp else None,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    # counted before training: ZeRO-3 leaves each rank only its partition (ds_numel is the whole size)
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    clock = StepClock()
    data = RandomTokens(args.batch * world * total_steps)
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[clock])
    # a configuration that silently fell back to DDP would be measured under the wrong name
    if args.fsdp and not trainer.is_fsdp_enabled:
        raise RuntimeError(
            "fsdp was asked for but the Trainer did not enable FSDP (no Accelerate fsdp_plugin)"
        )
    if args.deepspeed and not trainer.is_deepspeed_enabled:
        raise RuntimeError("--deepspeed was given but the Trainer did not enable DeepSpeed")
    output = trainer.train()
    if not trainer.is_world_process_zero():
        return
    timed_begins, timed_ends = clock.begins[args.warmup :], clock.ends[args.warmup :]
    span = timed_ends[-1] - timed_begins[0]
    steps = [end - begin for begin, end in zip(timed_begins, timed_ends, strict=True)]
    tokens_per_step = args.batch * seq * world
    result = {
        "model": "gpt2-tiny" if args.tiny else "gpt2-medium",
        "params": params,
        "batch_per_device": args.batch,
        "seq_len": seq,
        "world_size": world,
        "warmup": args.warmup,
        "steps": args.steps,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": round(tokens_per_step * args.steps / span, 1),
        "s_per_step": round(span / args.steps, 5),
        "step_s_median": round(sorted(steps)[len(steps) // 2], 5),
        "train_loss": round(output.training_loss, 4),
        "bf16": training.bf16,
        # the class that trained it: our engine (runtime.*) under deepspeed, torch's FSDP under fsdp
        "wrapped_by": f"{type(trainer.model_wrapped).__module__}.{type(trainer.model_wrapped).__qualname__}",
        "device": "cpu" if on_cpu else torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    if not on_cpu:
        result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    Path(args.result).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------- flags


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {CONFIGS}")
    parser.add_argument("--num_gpus", type=int, default=1, help="world size of every configuration")
    parser.add_argument("--batch", type=int, default=8, help="per-device batch (sequences)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per configuration")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for all configurations together")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer GPT-2 on 64 tokens (smoke check)")
    add_out_argument(parser, "hf-trainer")
    # worker side (the script the launchers start)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--output_dir", help=argparse.SUPPRESS)
    parser.add_argument("--deepspeed", help=argparse.SUPPRESS)
    parser.add_argument("--fsdp", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the launcher's
    args = parser.parse_args(argv)
    args.out = out_file(args.out, "hf-trainer")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        parser.error(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    if min(args.num_gpus, args.batch, args.steps) <= 0 or args.warmup < 0:
        parser.error("--num_gpus, --batch and --steps must be positive, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
