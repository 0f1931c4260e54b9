"""The longest sequence a Llama-shaped model trains on this machine with the long-sequence parts on.

    python scripts/bench/long_context.py --model 8b --out            # on the H200; JSON lines
    python scripts/bench/long_context.py --model 1b --gpu_gib 32 --start 198656 --growth 1.1 \
        --max 218112 --steps 2 --time_limit 120 --out                # a capped walk (BENCHMARKS.md, issue 34)
    python scripts/bench/long_context.py --model 256:512:2:4:2:1000 --device cpu --start 256 --max 2048

The model is built from its config numbers (``--model``: ``1b``, ``8b`` or
HIDDEN:INTERMEDIATE:LAYERS:HEADS:KV_HEADS:VOCAB; random bf16 weights, no download) as a HF
``LlamaForCausalLM`` with SDPA attention (flash kernels on the GPU), the tiled MLP
(``tile_llama_mlps``), the tiled loss (``tile_causal_lm_loss``) and its layers checkpointed through
runtime.activation_checkpointing (``hf_checkpointing``), keeping their inputs on the host unless
``--no_cpu_checkpointing``; each ``--no_tiled_*`` flag turns a part off; ``--lean_norms`` swaps the
RMSNorms for runtime.sequence.lean_norm's. It trains through
``runtime.initialize`` at ZeRO ``--stage`` (3) with the Adam state offloaded to the host (unless
``--no_offload``), micro-batch 1.

The walk (its decisions in long_context_walk.py): each length runs ``--steps`` steps (one warm-up, then
timed; ``--steps 1`` times its only step) in its own process (an out-of-memory error ends only that
process), growing from ``--start`` by ``--growth`` (2: doubling) until one fails or ``--max`` is passed,
then bisecting between the longest that trained and the shortest that failed down to ``--resolution``
(5% of the length). One JSON line per try (seq_len, ok, step_s, tokens_per_s, TFLOP/s, mfu, peak GPU GiB
allocated and reserved, host RSS GiB, the error's last line) and a summary: the longest length, what
ended the walk (``stopped_by``: failed, max, time), what ``ds_estimate --longest_seq`` predicts for this
machine (GPU memory and the host's available memory read once), which side binds there
(``estimate_binds``), the estimate's error (issue 34 asks for 5%) and ``step_s_at_estimate`` (the step's
executed FLOPs at the estimate over the executed rate measured at the longest).

A real limit may lie where one step takes minutes (the 8B shape at 500K tokens: ~3e17 FLOPs), beyond a
10-minute device command. Two flags keep a walk inside one:

- ``--gpu_gib G``: each child caps its CUDA caching allocator at G GiB
  (``torch.cuda.set_per_process_memory_fraction``, before anything is allocated), and the estimate is for
  that GPU (``runtime.estimator.fit.allocator_capped``: the CUDA context lies outside the cap, the
  allocator's slack is a share of the cap); ``torch.cuda.mem_get_info`` answers for the cap too, so what
  the engine sizes by free memory (the offloaded step's staging slots) is sized for the capped GPU. With
  a small G the limit falls where a step takes seconds, and the walk checks the estimator's memory model
  there; the summary says when the host term binds first (``estimate_note``), for then the walk checks
  the host side instead.
- ``--time_limit S``: a length whose predicted step time (runtime.estimator.step_flops's executed FLOPs
  over the last measured executed rate) passes S seconds is not tried; the summary says
  ``stopped_by: time`` and the length it would have tried (``would_try``).

FLOPs: ``tflops`` and ``mfu`` count the model's, 6 x parameters x T + 6 x layers x hidden x T^2 (causal
attention's score and value products, half the square), as MFU conventionally does; ``hw_tflops`` counts
what runs, the recomputation of the checkpointed layers and of the tiled MLP included
(runtime/estimator/step_flops.py).
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runtime.estimator.fit import GIB, Machine, allocator_capped  # noqa: E402
from runtime.estimator.fit_cli import llama_shape  # noqa: E402
from runtime.estimator.longest import LlamaShape, LongSequenceSetup, longest_sequence  # noqa: E402
from runtime.estimator.step_flops import model_flops, step_flops, step_seconds  # noqa: E402
from scripts.bench import memory_peak  # noqa: E402
from scripts.bench.common import add_out_argument, emit, mfu, out_file, run_isolated  # noqa: E402
from scripts.bench.long_context_walk import WalkPlan, walk_lengths  # noqa: E402

# a raised exception's last line in a traceback: "torch.OutOfMemoryError: ...", "RuntimeError: ..."
EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b")


def setup_from(args: argparse.Namespace) -> LongSequenceSetup:
    return LongSequenceSetup(
        tiled_mlp=not args.no_tiled_mlp,
        tiled_loss=not args.no_tiled_loss,
        cpu_checkpointing=not args.no_cpu_checkpointing,
        lean_norms=args.lean_norms,
        stage=args.stage,
        offload_optimizer=not args.no_offload,
        master_dtype="bf16" if args.bf16_master_weights or args.bf16_optimizer_states else "fp32",
        state_dtype="bf16" if args.bf16_optimizer_states else "fp32",
    )


def cap_allocator(device: Any, gpu_gib: float) -> None:
    """Make this process's GPU one of `gpu_gib` GiB, before anything is allocated: its CUDA caching
    allocator capped there (the fraction is of the device's total memory; the CUDA context lies outside
    it), and ``torch.cuda.mem_get_info`` answering for the cap (free: the cap less what the allocator has
    reserved), because the engine sizes things by the free memory it reads: the offloaded device step's
    staging slots take 1/16 of it (runtime/offload/plan.py), which on the whole card would be up to 4 GiB
    the capped GPU has no room for, and which the estimate for the capped GPU would not count."""
    import torch

    # set_per_process_memory_fraction wants an index: a bare "cuda" device is the current one
    index = torch.device(device).index
    device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
    total = torch.cuda.get_device_properties(device).total_memory
    cap = int(gpu_gib * GIB)
    if cap > total:
        raise SystemExit(f"--gpu_gib {gpu_gib}: the GPU has only {total / GIB:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(cap / total, device)

    def capped_mem_get_info(_: Any = None) -> tuple[int, int]:  # this process has the one GPU
        return max(0, cap - torch.cuda.memory_reserved(device)), cap

    torch.cuda.mem_get_info = capped_mem_get_info


def train_one(
    shape: LlamaShape,
    setup: LongSequenceSetup,
    seq: int,
    steps: int,
    device_name: str,
    gpu_gib: float | None = None,
    memory_trace: bool = False,
) -> dict:
    """Train `steps` steps at length `seq` in this process (its allocator capped at `gpu_gib` GiB where
    given); the measurements as a dict, with what the allocator held at its peak by site where
    `memory_trace` (scripts/bench/memory_peak.py; the recording slows the step: not for timing)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import runtime
    from runtime import activation_checkpointing
    from runtime.sequence import lean_llama_norms, tile_causal_lm_loss, tile_llama_mlps
    from scripts.bench.common import init_single_process_group

    device = torch.device(device_name)
    if device.type == "cuda" and device.index is None:  # torch 2.11's set_device refuses a bare "cuda"
        device = torch.device("cuda", torch.cuda.current_device())
    if gpu_gib is not None and device.type == "cuda":
        cap_allocator(device, gpu_gib)
    tracing = memory_trace and device.type == "cuda"
    if tracing:
        memory_peak.start_trace()
    init_single_process_group(device)
    config = LlamaConfig(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        vocab_size=shape.vocab_size,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=max(seq, 2048),
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    if setup.tiled_mlp:
        tile_llama_mlps(model)
    if setup.tiled_loss:
        tile_causal_lm_loss(model)
    if setup.lean_norms:
        lean_llama_norms(model)
    activation_checkpointing.configure(checkpoint_in_cpu=setup.cpu_checkpointing)
    activation_checkpointing.hf_checkpointing(model)
    zero: dict[str, Any] = {"stage": setup.stage}
    if setup.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    bf16: dict[str, Any] = {"enabled": True}
    if setup.master_dtype == "bf16":  # issue 32's 16-bit state keys: 6 bytes a parameter of Adam, not 16
        bf16["bf16_master_weights_and_grads"] = True
        bf16["bf16_optimizer_states"] = setup.state_dtype == "bf16"
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 0,
        "bf16": bf16,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
        "zero_optimization": zero,
    }
    engine, _, _, _ = runtime.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    gen = torch.Generator().manual_seed(0)

    def step() -> float:
        ids = torch.randint(0, shape.vocab_size, (1, seq), generator=gen).to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    # one warm-up step, then the timed ones; --steps 1 times its only step, warm-up and all (a length whose
    # step takes minutes affords no second one in a device command)
    losses = [step()] if steps > 1 else []
    if device.type == "cuda" and steps > 1:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    timed = max(1, steps - 1)
    start = time.perf_counter()
    for _ in range(timed):
        losses.append(step())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    step_s = (time.perf_counter() - start) / timed
    flops = model_flops(shape, seq)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    record = {
        "losses": losses,
        "step_s": round(step_s, 4),
        "tokens_per_s": round(seq / step_s, 1),
        "tflops": round(flops / step_s / 1e12, 2),
        # 4 significant digits, not 2 decimals: the time limit predicts from it, tiny CPU rates included
        "hw_tflops": float(f"{step_flops(shape, seq, setup) / step_s / 1e12:.4g}"),
        "mfu": mfu(flops / step_s, name),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if name else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2) if name else None,
        "host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
    if tracing:
        record["memory_trace"] = memory_peak.peak_breakdown(memory_peak.device_trace(device))
    return record


def try_length(args: argparse.Namespace, seq: int) -> dict:
    """One length in a fresh process: its measurements, or ok=False and the error's last line."""
    command = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--one", str(seq)]
    done = run_isolated(command, args.timeout, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return {"seq_len": seq, "ok": True, **json.loads(lines[-1])}
    stderr = done.stderr.strip().splitlines() or ["(no output)"]
    # the raising frame, and the last one of ours (the caller, where the raise is inside torch)
    frames = [line.strip() for line in stderr if line.lstrip().startswith('File "')]
    ours = [frame for frame in frames if "site-packages" not in frame]
    where = list(dict.fromkeys(frames[-1:] + ours[-1:]))
    error = "timeout" if done.returncode is None else " at ".join([error_line(stderr)[-300:], *where])
    return {"seq_len": seq, "ok": False, "error": error}


def error_line(stderr: list[str]) -> str:
    """The exception's own line of a failed child's stderr (``torch.OutOfMemoryError: ...``), not a warning
    printed after it at exit (NCCL's about an undestroyed process group); the last line if none is."""
    raised = [line for line in stderr if EXCEPTION_LINE.match(line)]
    return (raised or stderr)[-1]


def machine_facts(device_name: str) -> Machine:
    """This machine's GPU memory and the host's available memory, read once (in a child for the GPU, so
    this process holds no CUDA context while the tries run)."""
    from runtime.memory import host_available_bytes

    gpu = 0
    if device_name.startswith("cuda"):
        code = "import json, torch; print(json.dumps(torch.cuda.mem_get_info(0)[1]))"
        gpu = int(run_isolated([sys.executable, "-c", code], 180).stdout.strip().splitlines()[-1])
    return Machine(gpu_bytes=gpu, host_bytes=host_available_bytes())


def estimate_machine(gpu_gib: float | None, device_name: str) -> Machine:
    """The machine the estimate is for: a GPU of `gpu_gib` GiB where the children cap their allocator
    (``allocator_capped``: the context outside the cap), else this GPU's full size; the host's available
    memory either way."""
    if gpu_gib is None:
        return machine_facts(device_name)
    from runtime.memory import host_available_bytes

    return allocator_capped(int(gpu_gib * GIB), host_available_bytes())


def estimate_summary(
    shape: LlamaShape, setup: LongSequenceSetup, machine: Machine, longest: int, hw_tflops: float | None
) -> dict[str, Any]:
    """The summary's estimate keys: ``longest_sequence`` on `machine`, which side binds there, its error
    against the measured `longest`, and the step time at the estimate at the measured executed rate."""
    estimate = longest_sequence(shape, machine, setup)
    keys: dict[str, Any] = {
        "estimate": estimate.seq_len,
        "estimate_binds": estimate.binds,
        "estimate_reason": estimate.reason,
        "estimate_error": round(estimate.seq_len / longest - 1, 4) if longest else None,
        "estimate_machine": {
            "gpu_gib": round(machine.gpu_bytes / GIB, 2),
            "host_gib": round(machine.host_bytes / GIB, 2),
        },
        "step_s_at_estimate": None,
    }
    if "host" in estimate.binds:
        # the walk then checks the host side of the estimate (or both), not the GPU term a cap aims at
        keys["estimate_note"] = "the host term binds at the estimate, not (only) the GPU's"
    if hw_tflops and estimate.seq_len:
        keys["step_s_at_estimate"] = round(
            step_seconds(step_flops(shape, estimate.seq_len, setup), hw_tflops), 2
        )
    return keys


def walk(args: argparse.Namespace, shape: LlamaShape, setup: LongSequenceSetup, out: Path | None) -> dict:
    tried: dict[int, dict] = {}
    rate: list[float] = []  # executed TFLOP/s of the lengths that trained, in order

    def attempt(seq: int) -> bool:
        record = try_length(args, seq)
        tried[seq] = record
        emit({"bench": "long_context", "model": args.model, "setup": asdict(setup), **record}, out)
        if record["ok"] and record.get("hw_tflops"):
            rate.append(record["hw_tflops"])
        return bool(record["ok"])

    def predict_s(seq: int) -> float | None:
        return step_seconds(step_flops(shape, seq, setup), rate[-1]) if rate else None

    plan = WalkPlan(
        start=args.start,
        max=args.max,
        multiple=args.multiple,
        resolution=args.resolution,
        growth=args.growth,
        time_limit=args.time_limit,
    )
    result = walk_lengths(plan, attempt, predict_s)
    good = result.longest
    summary: dict[str, Any] = {"bench": "long_context", "summary": True, "model": args.model, "longest": good}
    summary |= {"stopped_by": result.stopped_by, "would_try": result.would_try, "gpu_gib": args.gpu_gib}
    keys = ("tokens_per_s", "tflops", "hw_tflops", "mfu", "peak_gpu_gib", "peak_reserved_gib")
    summary |= {k: tried[good].get(k) for k in keys} if good else {}
    if args.device.startswith("cuda"):
        machine = estimate_machine(args.gpu_gib, args.device)
        summary |= estimate_summary(shape, setup, machine, good, summary.get("hw_tflops"))
    emit(summary, out)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="8b", help="1b, 8b, or HIDDEN:INTERMEDIATE:LAYERS:HEADS:KV:VOCAB")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--start", type=int, default=16384)
    parser.add_argument("--max", type=int, default=4 << 20)
    parser.add_argument("--multiple", type=int, default=1024, help="lengths are multiples of this")
    parser.add_argument("--resolution", type=float, default=0.05, help="stop bisecting within this share")
    parser.add_argument(
        "--growth", type=float, default=2.0, help="on the way up, each length is this times the last"
    )
    parser.add_argument(
        "--gpu_gib",
        type=float,
        help="cap each child's CUDA allocator at this many GiB (the estimate is for that GPU size)",
    )
    parser.add_argument(
        "--time_limit",
        type=float,
        help="seconds: a length whose predicted step time (the last measured rate) exceeds it is not tried",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=3,
        help="steps a length (the first is a warm-up; 1: the one step is timed, warm-up and all)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a length may take")
    parser.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    parser.add_argument("--no_offload", action="store_true", help="the Adam state stays on the GPU")
    parser.add_argument("--no_tiled_mlp", action="store_true")
    parser.add_argument("--no_tiled_loss", action="store_true")
    parser.add_argument("--no_cpu_checkpointing", action="store_true")
    parser.add_argument(
        "--lean_norms", action="store_true", help="RMSNorms keep their bf16 input, not fp32 copies"
    )
    parser.add_argument(
        "--bf16_master_weights", action="store_true", help="bf16.bf16_master_weights_and_grads"
    )
    parser.add_argument(
        "--bf16_optimizer_states", action="store_true", help="bf16.bf16_optimizer_states (and bf16 masters)"
    )
    parser.add_argument(
        "--memory_trace",
        action="store_true",
        help="each length's record adds what the GPU held at its peak, by where it was allocated (slower)",
    )
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: train this length only
    add_out_argument(parser, "long_context")
    args = parser.parse_args(argv)
    try:
        shape = llama_shape(args.model)
    except argparse.ArgumentTypeError as error:
        parser.error(f"--model: {error}")
    if args.steps < 1:
        parser.error(f"--steps: expected at least 1, got {args.steps}")
    setup = setup_from(args)
    if args.one is not None:
        record = train_one(shape, setup, args.one, args.steps, args.device, args.gpu_gib, args.memory_trace)
        print(json.dumps(record), flush=True)
        return 0
    try:
        summary = walk(args, shape, replace(setup), out_file(args.out, "long_context"))
    except ValueError as error:  # the walk's bounds (WalkPlan)
        parser.error(str(error))
    return 0 if summary["longest"] else 1


if __name__ == "__main__":
    sys.exit(main())
