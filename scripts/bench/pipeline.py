"""Pipeline bubble: the measured idle fraction of PipelineEngine's schedules against (p-1)/(m+p-1), and
of the interleaved schedules (v chunks per stage) against (p-1)/(v*m+p-1).

Starts P CPU ranks (gloo), one pipeline of P stages (dp 1). Each stage is one layer of known cost: its
forward sleeps `--forward_ms`, its backward `--backward_ms` (sleeps, not compute, so the 2 shared cores
do not blur the costs; the stages still wait on each other exactly as compute would make them). Per
train_batch, each rank records the time its layer spent in forward and backward (busy) and the wall time
of the whole train_batch (which includes the ZeRO step and the loss broadcast); idle = 1 - busy / wall,
averaged over stages, median over `--steps` batches after one warm-up batch (the first batch also infers
shapes). The ideal 1F1B and GPipe schedules with equal stages both idle for (p-1)/(m+p-1) of the step.

Interleaved schedules ("interleaved_1f1b", "looped_bfs") run `--chunks` v chunks per stage, each one
layer costing 1/v of the stage's forward and backward (the same work per rank as one chunk), so the
bubble shrinks to (p-1)/(v*m+p-1). The JSON line also carries `schedule_order_idle`: the idle fraction
of torch's own action order for these costs (`simulated_idle`: every rank runs its actions in order, an
action starting once its input is there, communication free), which checks the formula against what
torch actually schedules.

Output: one JSON line per (schedule, micro-batches) with the measured and theoretical idle fractions and
their ratio, stamped with the commit, date, machine and command (common.py); --out appends them to a
file too.

    python scripts/bench/pipeline.py --stages 4 --micro_batches 4,8,16 --schedules 1f1b,gpipe,interleaved_1f1b
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from scripts.bench.common import add_out_argument, emit, out_file, real_deepspeed  # noqa: E402

BUSY: list[float] = []  # seconds this rank's layer spent in forward and backward, per call
MULTI_CHUNK = ("interleaved_1f1b", "looped_bfs")


def simulated_idle(order: dict[int, list[Any]], chunks: int, forward_s: float, backward_s: float) -> float:
    """The idle fraction of a torch schedule's action order (`pipeline_order`: rank -> actions, None for
    a wait) when each chunk's forward costs forward_s / chunks and its backward backward_s / chunks:
    every rank runs its actions in order, each starting when the rank is free and its input exists
    (the previous virtual stage's forward, the next one's backward, or its own forward on the last)."""
    actions = {rank: [a for a in acts if a is not None] for rank, acts in order.items()}
    last = len(order) * chunks - 1
    done: dict[tuple[str, int, int], float] = {}
    clock = dict.fromkeys(actions, 0.0)
    at = dict.fromkeys(actions, 0)
    moved = True
    while moved:
        moved = False
        for rank, acts in actions.items():
            while at[rank] < len(acts):
                action = acts[at[rank]]
                kind = action.computation_type.value
                stage, micro = action.stage_index, action.microbatch_index
                if kind == "F":
                    needs = None if stage == 0 else ("F", stage - 1, micro)
                else:
                    needs = ("F", stage, micro) if stage == last else ("B", stage + 1, micro)
                if needs is not None and needs not in done:
                    break
                start = max(clock[rank], done[needs] if needs else 0.0)
                clock[rank] = start + (forward_s if kind == "F" else backward_s) / chunks
                done[(kind, stage, micro)] = clock[rank]
                at[rank] += 1
                moved = True
    if any(at[rank] < len(acts) for rank, acts in actions.items()):
        raise RuntimeError("the schedule's order deadlocks")
    busy = sum(forward_s if a.computation_type.value == "F" else backward_s for a in actions[0]) / chunks
    return 1.0 - busy / max(clock.values())


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, forward_s: float, backward_s: float
    ) -> torch.Tensor:
        ctx.backward_s = backward_s
        start = time.perf_counter()
        time.sleep(forward_s)
        BUSY.append(time.perf_counter() - start)
        return x * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        start = time.perf_counter()
        time.sleep(ctx.backward_s)
        BUSY.append(time.perf_counter() - start)
        return grad, grad.sum().reshape(1) * 0, None, None


class SleepLayer(nn.Module):
    """A stage of known cost: forward and backward each take a fixed time."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.weight, self.forward_s, self.backward_s)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).mean()


def _build(kind: str, world: int, micro: int, schedule: str, args: argparse.Namespace) -> Any:
    """Our PipelineEngine, or DeepSpeed's (kind "deepspeed", run from a DeepSpeed venv), on the same job."""
    config = {
        "train_batch_size": micro,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": micro,
        "steps_per_print": 10**6,
        "gradient_clipping": 0.0,  # DeepSpeed 0.19 defaults it to 1.0
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
    }
    cost = (args.forward_ms / 1e3, args.backward_ms / 1e3)
    if kind == "deepspeed":
        deepspeed = real_deepspeed()  # never our compat package under its name
        from deepspeed.pipe import LayerSpec as DSLayerSpec
        from deepspeed.pipe import PipelineModule as DSPipelineModule

        deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group made above

        module = DSPipelineModule(
            [DSLayerSpec(SleepLayer, *cost) for _ in range(world)],
            num_stages=world,
            loss_fn=_mse,
            partition_method="uniform",
        )
        engine, *_ = deepspeed.initialize(
            model=module, config=config, model_parameters=list(module.parameters())
        )
        return engine
    from runtime.pipe import LayerSpec, PipelineEngine, PipelineModule

    chunks = args.chunks if schedule in MULTI_CHUNK else 1
    module = PipelineModule(
        [LayerSpec(SleepLayer, cost[0] / chunks, cost[1] / chunks) for _ in range(world * chunks)],
        num_stages=world,
        loss_fn=_mse,
        partition_method="uniform",
        chunks_per_stage=chunks,
    )
    return PipelineEngine(module, {**config, "pipeline": {"schedule": schedule}})


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, results: Any) -> None:
    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(args.port),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)

    try:
        for schedule in args.schedules.split(","):
            for micro in (int(m) for m in args.micro_batches.split(",")):
                engine = _build(args.engine, world, micro, schedule, args)
                idles, walls = [], []
                for step in range(args.steps + 1):
                    data = iter([(torch.ones(1, 4), torch.zeros(1, 4))] * micro)
                    BUSY.clear()
                    dist.barrier()
                    start = time.perf_counter()
                    engine.train_batch(data)
                    wall = time.perf_counter() - start
                    if step == 0:
                        continue  # shape inference and first-call costs
                    idle = torch.tensor([1.0 - sum(BUSY) / wall])
                    dist.all_reduce(idle)
                    idles.append(float(idle) / world)
                    walls.append(wall)
                if rank == 0:
                    chunks = args.chunks if schedule in MULTI_CHUNK and args.engine == "ours" else 1
                    slots = chunks * micro + world - 1  # the ideal step in chunk-sized time slots
                    theory = (world - 1) / slots
                    idle = statistics.median(idles)
                    order = getattr(engine, "_schedule", None)
                    simulated = None
                    if chunks > 1 and order is not None:
                        simulated = simulated_idle(
                            order.pipeline_order, chunks, args.forward_ms, args.backward_ms
                        )
                    results.put(
                        {
                            "bench": "pipeline_idle",
                            "engine": args.engine,
                            "schedule": "1f1b (DeepSpeed TrainSchedule)"
                            if args.engine == "deepspeed"
                            else schedule,
                            "stages": world,
                            "chunks": chunks,
                            "micro_batches": micro,
                            "forward_ms": args.forward_ms,
                            "backward_ms": args.backward_ms,
                            "step_s": round(statistics.median(walls), 4),
                            "ideal_step_s": round(
                                slots * (args.forward_ms + args.backward_ms) / chunks / 1e3, 4
                            ),
                            "idle_fraction": round(idle, 4),
                            "theory": round(theory, 4),
                            "ratio": round(idle / theory, 3),
                            "schedule_order_idle": None if simulated is None else round(simulated, 4),
                        }
                    )
                if hasattr(engine, "destroy"):
                    engine.destroy()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro_batches", default="4,8,16")
    parser.add_argument("--schedules", default="1f1b,gpipe,interleaved_1f1b")
    parser.add_argument(
        "--chunks", type=int, default=2, help="chunks per stage for interleaved_1f1b and looped_bfs"
    )
    parser.add_argument("--forward_ms", type=float, default=50.0)
    parser.add_argument("--backward_ms", type=float, default=100.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--engine", choices=("ours", "deepspeed"), default="ours")
    parser.add_argument(
        "--peer_python",
        default=None,
        help="a python with DeepSpeed installed: also run the 1F1B job under DeepSpeed's PipelineEngine "
        "and print each step time's ratio to ours",
    )
    parser.add_argument("--port", type=int, default=29571, help=argparse.SUPPRESS)
    add_out_argument(parser, "pipeline")
    args = parser.parse_args()
    args.out = out_file(args.out, "pipeline")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, args.stages, store, args, results))
            for r in range(args.stages)
        ]
        for proc in procs:
            proc.start()
        expected = len(args.schedules.split(",")) * len(args.micro_batches.split(","))
        ours = []
        for _ in range(expected):
            ours.append(_next_result(results, procs))
            emit(ours[-1], args.out)
        for proc in procs:
            proc.join()
            if proc.exitcode:
                raise SystemExit(f"a rank exited with {proc.exitcode}")
    if args.peer_python and args.engine == "ours":
        _compare_with_deepspeed(args, [r for r in ours if r["schedule"] == "1f1b"])


def _next_result(results: Any, procs: list[Any]) -> dict:
    """The next result; a rank that died fails the run at once instead of after a long timeout."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode]
            if dead:
                raise SystemExit(f"a rank exited with {dead[0]}") from None
    raise SystemExit("no result within 600 s")


def _compare_with_deepspeed(args: argparse.Namespace, ours: list[dict]) -> None:
    command = [
        args.peer_python,
        __file__,
        "--engine=deepspeed",
        "--schedules=1f1b",
        f"--stages={args.stages}",
        f"--micro_batches={args.micro_batches}",
        f"--forward_ms={args.forward_ms}",
        f"--backward_ms={args.backward_ms}",
        f"--steps={args.steps}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the DeepSpeed run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    peer = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            peer[record["micro_batches"]] = record
            emit(record, args.out)  # with its own provenance: the peer's Python and torch
    for record in ours:
        theirs = peer[record["micro_batches"]]
        summary = {
            "bench": "pipeline_vs_deepspeed",
            "stages": record["stages"],
            "micro_batches": record["micro_batches"],
            "ours_step_s": record["step_s"],
            "deepspeed_step_s": theirs["step_s"],
            "ratio": round(record["step_s"] / theirs["step_s"], 3),
        }
        emit(summary, args.out)


if __name__ == "__main__":
    main()
