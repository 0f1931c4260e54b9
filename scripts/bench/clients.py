"""Throughput of the clients one step further out: PyTorch Lightning's `DeepSpeedStrategy(stage=3)` beside
Lightning's DDP strategy, and `accelerate launch` with DeepSpeed ZeRO-3 beside plain Accelerate, each on
dslaunch through the `deepspeed` compat package, in one run.

The workload is GPT-2 medium built from GPT2Config (no hub; n_positions 1024), sequences of 1024 random
tokens made here, bf16 mixed precision, torch AdamW (lr 1e-4, weight decay 0.01), a fixed per-device batch;
--warmup steps, then --steps timed steps. Each configuration is launched the way its users launch it, in
its own subprocess with a timeout:

    lightning-ddp    python clients.py --worker lightning --strategy ddp
    lightning-ds3    python clients.py --worker lightning --strategy deepspeed   (DeepSpeedStrategy(stage=3))
    accelerate       accelerate launch --num_processes 1 --mixed_precision bf16 clients.py --worker accelerate
    accelerate-ds3   accelerate launch --use_deepspeed --zero_stage 3 --num_processes 1 ...  (same script)

At world 1 (this bench's size) Lightning's "ddp" is a process group of one and plain Accelerate is one
process without a wrapper: the unsharded runs each client's users compare against. The worker times the
optimizer steps itself: a device synchronize and a clock reading at each step's begin and end; tokens/s is
the timed steps' tokens over the wall time from the first timed step's begin to the last one's end.

Output: one JSON line per configuration on stdout (also appended to --out FILE, or with a bare --out to
results/<yyyymmdd>_<hw>_clients.jsonl), stamped with the commit, date, machine and command (common.py), a
failing or timed-out one with "error", then a summary line with `ratio_to_unsharded`: lightning-ds3 to
lightning-ddp, accelerate-ds3 to accelerate. Each configuration gets --timeout seconds, all of them
together --budget. On CPU (`--device cpu --tiny`, the smoke check) training is fp32 and Lightning's
DeepSpeedStrategy runs through a subclass that lifts only its CUDA-only device checks.

    python scripts/bench/clients.py                                        # H100/H200: about 4 minutes
    DS_ACCELERATOR=cpu python scripts/bench/clients.py --device cpu --tiny  # smoke check, no GPU
"""

from __future__ import annotations

import argparse
import json
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
from scripts.bench.hf_trainer import worker_env  # noqa: E402

CONFIGS = ("lightning-ddp", "lightning-ds3", "accelerate", "accelerate-ds3")
PAIRS = {"lightning-ds3": "lightning-ddp", "accelerate-ds3": "accelerate"}
SEQ_LEN, SEQ_LEN_TINY = 1024, 64
MEDIUM = {"n_embd": 1024, "n_layer": 24, "n_head": 16}  # GPT2Config()'s defaults are GPT-2 small
TINY = {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 512, "bos_token_id": 0, "eos_token_id": 0}


# ---------------------------------------------------------------------------------------------- driver


def accelerate_command() -> list[str]:
    """The `accelerate` console script beside this Python (or on PATH), else its module."""
    beside = Path(sys.executable).parent / "accelerate"
    found = str(beside) if beside.exists() else shutil.which("accelerate")
    return [found, "launch"] if found else [sys.executable, "-m", "accelerate.commands.launch"]


def launch_command(config: str, args: argparse.Namespace, workdir: Path) -> list[str]:
    """The command line a user would type for this configuration."""
    client = config.split("-")[0]
    worker = [str(Path(__file__).resolve()), "--worker", client, "--result", str(workdir / f"{config}.json"),
              "--batch", str(args.batch), "--warmup", str(args.warmup), "--steps", str(args.steps),
              "--device", args.device, *(["--tiny"] if args.tiny else [])]  # fmt: skip
    if client == "lightning":
        return [sys.executable, *worker, "--strategy", "deepspeed" if config.endswith("ds3") else "ddp"]
    on_cpu = args.device == "cpu"
    launch = [*accelerate_command(), "--num_processes", "1", "--num_machines", "1", "--dynamo_backend", "no",
              "--mixed_precision", "no" if on_cpu else "bf16",
              "--main_process_port", str(free_port())]  # fmt: skip
    if config == "accelerate":
        return [*launch, *(["--cpu"] if on_cpu else []), *worker]
    ds = [
        "--use_deepspeed",
        "--zero_stage",
        "3",
        "--gradient_accumulation_steps",
        "1",
        "--zero3_init_flag",
        "false",
    ]
    return [*launch, *ds, *worker]


def run_config(config: str, args: argparse.Namespace, workdir: Path, timeout: float) -> dict[str, Any]:
    record: dict[str, Any] = {"bench": "clients", "config": config, "world_size": 1}
    command = launch_command(config, args, workdir)
    record["command"] = shlex.join(command)
    if timeout <= 0:
        record["error"] = f"not run: the --budget of {args.budget} s was spent by the configurations before"
        return record
    done = run_isolated(
        command, timeout, cwd=workdir, env=worker_env(args.device, workdir), merge_stderr=True
    )
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
    ratios = {
        config: round(speeds[config] / speeds[base], 4) if config in speeds and speeds.get(base) else None
        for config, base in PAIRS.items()
    }
    failed = [r["config"] for r in records if "error" in r]
    return {"bench": "clients", "event": "summary", "tokens_per_s": speeds, "ratio_to_unsharded": ratios,
            "failed": failed}  # fmt: skip


def drive(args: argparse.Namespace) -> int:
    records = []
    deadline = time.monotonic() + args.budget  # the whole run's, so a slow configuration cannot eat the call
    with tempfile.TemporaryDirectory(prefix="clients_bench_") as tmp:
        for config in args.configs:
            record = run_config(config, args, Path(tmp), min(args.timeout, deadline - time.monotonic()))
            emit(record, args.out)
            records.append(record)
    emit(summary(records), args.out)
    return 0 if all("error" not in r for r in records) else 1


# ---------------------------------------------------------------------------------------------- workers


class StepClock:
    """Device-synchronized clock readings at every optimizer step's begin and end."""

    def __init__(self, synchronize: Any) -> None:
        self.synchronize = synchronize
        self.begins: list[float] = []
        self.ends: list[float] = []

    def begin(self) -> None:
        self.synchronize()
        self.begins.append(time.perf_counter())

    def end(self) -> None:
        self.synchronize()
        self.ends.append(time.perf_counter())

    def result(self, args: argparse.Namespace, seq: int, losses: list[float]) -> dict[str, Any]:
        begins, ends = self.begins[args.warmup :], self.ends[args.warmup :]
        span = ends[-1] - begins[0]
        steps = sorted(end - begin for begin, end in zip(begins, ends, strict=True))
        tokens_per_step = args.batch * seq
        return {
            "tokens_per_step": tokens_per_step,
            "tokens_per_s": round(tokens_per_step * args.steps / span, 1),
            "s_per_step": round(span / args.steps, 5),
            "step_s_median": round(steps[len(steps) // 2], 5),
            "first_loss": round(losses[0], 4),
            "last_loss": round(losses[-1], 4),
        }


def workload(args: argparse.Namespace) -> tuple[Any, Any, int]:
    """The model (built from a config, seed 0), the random-token data set, the sequence length."""
    import torch
    from torch.utils.data import TensorDataset
    from transformers import GPT2Config, GPT2LMHeadModel

    seq = SEQ_LEN_TINY if args.tiny else SEQ_LEN
    config = GPT2Config(n_positions=seq, **(TINY if args.tiny else MEDIUM))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    rows = torch.randint(0, config.vocab_size, (args.batch * (args.warmup + args.steps), seq),
                         generator=torch.Generator().manual_seed(1234))  # fmt: skip
    return model, TensorDataset(rows), seq


def common_result(args: argparse.Namespace, model: Any, extra: dict[str, Any]) -> dict[str, Any]:
    import torch

    on_cpu = args.device == "cpu"
    result = {
        "model": "gpt2-tiny" if args.tiny else "gpt2-medium",
        "params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
        "batch_per_device": args.batch,
        "seq_len": SEQ_LEN_TINY if args.tiny else SEQ_LEN,
        "warmup": args.warmup,
        "steps": args.steps,
        "bf16": not on_cpu,
        "device": "cpu" if on_cpu else torch.cuda.get_device_name(),
        **extra,
    }
    if not on_cpu:
        result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return result


def lightning_worker(args: argparse.Namespace) -> None:
    """A LightningModule around the model, trained by Lightning's Trainer as its users write it."""
    import pytorch_lightning as pl
    import torch
    from lightning_fabric.utilities.seed import reset_seed
    from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy
    from torch.utils.data import DataLoader

    on_cpu = args.device == "cpu"
    model, data, seq = workload(args)
    clock = StepClock(torch.cuda.synchronize if not on_cpu else lambda: None)

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lm = model
            self.losses: list[float] = []

        def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
            loss = self.lm(input_ids=batch[0], labels=batch[0]).loss
            self.losses.append(loss.detach())
            return loss

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            clock.begin()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            clock.end()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01)

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):  # the CPU smoke check only: Lightning refuses non-CUDA
        def setup_environment(self) -> None:
            super(DeepSpeedStrategy, self).setup_environment()

        def setup_distributed(self) -> None:
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

    backend = "gloo" if on_cpu else "nccl"
    if args.strategy == "ddp":
        strategy: Any = DDPStrategy(process_group_backend=backend)
    else:
        strategy = (CPUDeepSpeedStrategy if on_cpu else DeepSpeedStrategy)(
            stage=3, process_group_backend=backend
        )
    trainer = pl.Trainer(
        accelerator="cpu" if on_cpu else "gpu",
        devices=1,
        strategy=strategy,
        precision="32-true" if on_cpu else "bf16-mixed",
        max_steps=args.warmup + args.steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    lm = LM()
    trainer.fit(lm, DataLoader(data, batch_size=args.batch, shuffle=False))
    losses = [float(x) for x in lm.losses]
    trained_by = type(trainer.strategy.model)
    extra = {**clock.result(args, seq, losses), "client": "lightning", "strategy": type(strategy).__name__,
             "trained_by": f"{trained_by.__module__}.{trained_by.__qualname__}"}  # fmt: skip
    Path(args.result).write_text(json.dumps(common_result(args, model, extra)))


def accelerate_worker(args: argparse.Namespace) -> None:
    """A plain Accelerate loop; `accelerate launch` decides DeepSpeed (or not) through the environment."""
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    accelerator = Accelerator()
    model, data, seq = workload(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    loader = DataLoader(data, batch_size=args.batch, shuffle=False)
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    on_cpu = args.device == "cpu"
    clock = StepClock(torch.cuda.synchronize if not on_cpu else lambda: None)
    losses = []
    engine.train()
    for (ids,) in loader:
        clock.begin()
        loss = engine(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        clock.end()
        losses.append(loss.detach())
    ds = accelerator.state.deepspeed_plugin
    extra = {**clock.result(args, seq, [float(x) for x in losses]), "client": "accelerate",
             "distributed_type": str(accelerator.distributed_type),
             "zero_stage": ds.zero_stage if ds else None,
             "trained_by": f"{type(engine).__module__}.{type(engine).__qualname__}"}  # fmt: skip
    Path(args.result).write_text(json.dumps(common_result(args, model, extra)))
    accelerator.end_training()


# ---------------------------------------------------------------------------------------------- flags


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {CONFIGS}")
    parser.add_argument("--batch", type=int, default=8, help="per-device batch (sequences)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per configuration")
    parser.add_argument("--budget", type=float, default=500.0, help="seconds for all configurations together")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer GPT-2 on 64 tokens (smoke check)")
    add_out_argument(parser, "clients")
    # worker side (the scripts the clients' launchers start)
    parser.add_argument("--worker", choices=("lightning", "accelerate"), help=argparse.SUPPRESS)
    parser.add_argument("--strategy", choices=("ddp", "deepspeed"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out = out_file(args.out, "clients")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        parser.error(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    if min(args.batch, args.steps) <= 0 or args.warmup < 0:
        parser.error("--batch and --steps must be positive, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "lightning":
        lightning_worker(args)
    elif args.worker == "accelerate":
        accelerate_worker(args)
    else:
        return drive(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
