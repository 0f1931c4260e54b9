"""``ds_estimate --largest``, ``--gpt E:H:L``, ``--longest_seq``: the machine-fit questions, as commands.

    ds_estimate --largest --gpu_memory 139 --host_memory 125                # ratio "auto", ZeRO-2
    ds_estimate --largest --gpu_memory 139 --host_memory 125 --ratio 1      # full optimizer offload
    ds_estimate --gpt 5120:40:48 --gpu_memory 139 --host_memory 125 --stage 3 --offload_param
    ds_estimate --longest_seq 8b --gpu_memory 139 --host_memory 125         # tiled MLP and loss
    ds_estimate --longest_seq 8b --gpu_memory 79 --host_memory 125 --tflops 450   # + the step's FLOPs, time
    ds_estimate --longest_seq 1b --gpu_cap 32 --host_memory 120             # a process capped at 32 GiB

The arithmetic is runtime.estimator.fit's (``--longest_seq``: runtime.estimator.longest's); this module
reads the flags, builds the GPT family the search walks (head size 128, widths 2048-12288, depths in steps
of 2), and prints one line per verdict, or JSON.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from typing import TypedDict

from runtime.estimator.fit import GIB, Fit, Machine, Workload, allocator_capped, fit_gpt, largest_gpt
from runtime.estimator.longest import (
    LLAMA_SHAPES,
    LlamaShape,
    LongSequenceSetup,
    SequenceFit,
    longest_over_settings,
    longest_sequence,
)
from runtime.estimator.step_flops import model_flops, step_flops, step_seconds
from runtime.models.gpt import GPTConfig

WIDTHS = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192, 10240, 12288)


def gpt_family() -> list[GPTConfig]:
    """The sizes `--largest` walks: each width in WIDTHS (head size 128), 4 to 128 layers in steps of 2."""
    return [GPTConfig(n_embd=e, n_head=e // 128, n_layer=n) for e in WIDTHS for n in range(4, 129, 2)]


def parse_ratio(text: str) -> float | str:
    """An `offload_optimizer.ratio` flag: a number from 0 to 1, or "auto" (kept as the string)."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, or auto, got {text!r}")
    return value


def _gib(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive size in GiB, got {text!r}")
    return int(value * GIB)


class _FitOptions(TypedDict):
    """The keyword arguments of `fit_gpt` that the command line sets."""

    stage: int
    offload_optimizer: bool
    offload_param: bool
    ratio: float | str
    host_step: bool | None


def fit_options(parser: argparse.ArgumentParser) -> None:
    """The flags of the fit questions (the shared --num_gpus, --dtype, --optimizer come from the caller)."""
    group = parser.add_argument_group("machine fit (--largest, --gpt)")
    group.add_argument("--gpu_memory", type=_gib, help="each GPU's memory in GiB (e.g. 139 for an H200)")
    group.add_argument("--host_memory", type=_gib, help="host memory the job may use, in GiB")
    group.add_argument(
        "--gpu_cap",
        type=_gib,
        help="instead of --gpu_memory: one process whose CUDA allocator is capped at this many GiB "
        "(scripts/bench/long_context.py --gpu_gib; the CUDA context lies outside the cap)",
    )
    group.add_argument(
        "--tflops",
        type=float,
        help="--longest_seq: also the step's FLOPs at the longest length and its time at this executed "
        "rate (TFLOP/s, recomputation included)",
    )
    group.add_argument("--stage", type=int, choices=(1, 2, 3), default=2, help="ZeRO stage (default 2)")
    group.add_argument("--ratio", type=parse_ratio, default="auto", help="offload ratio: 0-1 or auto")
    group.add_argument("--no_offload", action="store_true", help="no optimizer offload at all")
    group.add_argument("--offload_param", action="store_true", help="stage 3: weights on the host too")
    group.add_argument(
        "--host_step",
        action="store_true",
        help="the CPU updates the host share (default: where the engine would: the CPU with offload_param, "
        "bf16 master weights, another optimizer than Adam, or a host too small to pin the state)",
    )
    group.add_argument("--seq_len", type=int, default=1024)
    group.add_argument("--micro_batch", type=int, default=1)
    group.add_argument(
        "--no_activation_checkpointing", action="store_true", help="keep every block's activations"
    )
    group.add_argument("--no_tiled_mlp", action="store_true", help="--longest_seq: the plain MLP")
    group.add_argument("--no_tiled_loss", action="store_true", help="--longest_seq: the full logits")
    group.add_argument(
        "--no_cpu_checkpointing", action="store_true", help="--longest_seq: layer inputs stay on the GPU"
    )
    group.add_argument(
        "--lean_norms",
        action="store_true",
        help="--longest_seq: RMSNorms keep their 16-bit input, not fp32 copies (runtime.sequence.lean_norm)",
    )


def _setup_flags(setup: LongSequenceSetup) -> list[str]:
    """The ds_estimate flags (the same names as scripts/bench/long_context.py's) that ask for `setup`'s
    choices of state placement, dtypes, host checkpoints and norms."""
    flags = [] if setup.offload_optimizer else ["--no_offload"]
    if setup.master_dtype == "bf16":
        flags.append("--bf16_master_weights")
    if setup.state_dtype == "bf16":
        flags.append("--bf16_optimizer_states")
    if not setup.cpu_checkpointing:
        flags.append("--no_cpu_checkpointing")
    if setup.lean_norms:
        flags.append("--lean_norms")
    return flags


def llama_shape(text: str) -> LlamaShape:
    """A ``--longest_seq`` value: a preset (``1b``, ``8b``) or ``H:INTERMEDIATE:LAYERS:HEADS:KV:VOCAB``."""
    if text.lower() in LLAMA_SHAPES:
        return LLAMA_SHAPES[text.lower()]
    try:
        numbers = [int(part) for part in text.split(":")]
    except ValueError:
        numbers = []
    if len(numbers) != 6 or min(numbers) < 1 or numbers[0] % numbers[3] or numbers[3] % numbers[4]:
        raise argparse.ArgumentTypeError(
            f"expected {' or '.join(LLAMA_SHAPES)}, or HIDDEN:INTERMEDIATE:LAYERS:HEADS:KV_HEADS:VOCAB with "
            f"heads dividing hidden and kv heads dividing heads, got {text!r}"
        )
    hidden, intermediate, layers, heads, kv_heads, vocab = numbers
    return LlamaShape(hidden, intermediate, layers, heads, kv_heads, vocab)


def _step_keys(
    shape: LlamaShape, found: SequenceFit, setup: LongSequenceSetup, tflops: float | None
) -> dict[str, float]:
    """The step's FLOPs at the longest length (model and executed) and its seconds at `tflops`."""
    if tflops is None:
        return {}
    flops = step_flops(shape, found.seq_len, setup)
    return {
        "model_flops": model_flops(shape, found.seq_len),
        "step_flops": flops,
        "tflops": tflops,
        "step_s": round(step_seconds(flops, tflops), 1),
    }


def _step_text(shape: LlamaShape, found: SequenceFit, setup: LongSequenceSetup, tflops: float | None) -> str:
    keys = _step_keys(shape, found, setup, tflops)
    if not keys:
        return ""
    return (
        f"; a step there: {keys['step_flops']:.3g} FLOPs with the recomputation ({keys['model_flops']:.3g} "
        f"as MFU counts), {keys['step_s']:.1f} s at {tflops:g} TFLOP/s"
    )


def _line(fit: Fit | None, label: str) -> str:
    return f"{label}: none" if fit is None else f"{label}: {fit.reason}"


def run_fit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Answer --largest or --gpt; exit code 0 when it fits (or something does), 1 when not."""
    if (args.gpu_memory is None) == (args.gpu_cap is None) or args.host_memory is None:
        parser.error(
            "--largest, --gpt and --longest_seq need --host_memory and one of --gpu_memory, --gpu_cap (GiB)"
        )
    if args.offload_param and args.stage != 3:
        parser.error("--offload_param needs --stage 3")
    if args.tflops is not None and not args.tflops > 0:
        parser.error(f"--tflops: expected a positive rate, got {args.tflops}")
    if args.gpu_cap is not None:
        if args.num_gpus != 1:
            parser.error("--gpu_cap describes one process on one GPU (--num_gpus 1)")
        machine = allocator_capped(args.gpu_cap, args.host_memory)
    else:
        machine = Machine(gpu_bytes=args.gpu_memory, host_bytes=args.host_memory, gpus_per_node=args.num_gpus)
    work = Workload(
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        activation_checkpointing=not args.no_activation_checkpointing,
        dtype=args.dtype,
        optimizer=args.optimizer,
        master_dtype="bf16" if getattr(args, "bf16_master_weights", False) else "fp32",
        state_dtype="bf16" if getattr(args, "bf16_optimizer_states", False) else "fp32",
    )
    options: _FitOptions = {
        "stage": args.stage,
        "offload_optimizer": not args.no_offload,
        "offload_param": args.offload_param,
        "ratio": args.ratio,
        "host_step": True if args.host_step else None,  # None: where the engine would run it
    }
    if args.longest_seq is not None:
        setup = LongSequenceSetup(
            tiled_mlp=not args.no_tiled_mlp,
            tiled_loss=not args.no_tiled_loss,
            cpu_checkpointing=not args.no_cpu_checkpointing,
            lean_norms=args.lean_norms,
            dtype=args.dtype,
            stage=args.stage,
            offload_optimizer=not args.no_offload,
            offload_param=args.offload_param,
            master_dtype=work.master_dtype,
            state_dtype=work.state_dtype,
        )
        found = longest_sequence(args.longest_seq, machine, setup)
        # host checkpoints trade host memory for GPU memory: where the host is what fills (a large model
        # with its optimizer state offloaded), keeping them on the GPU can train longer; show both
        other = replace(setup, cpu_checkpointing=not setup.cpu_checkpointing)
        alternative = longest_sequence(args.longest_seq, machine, other)
        label = "without" if setup.cpu_checkpointing else "with"
        # and the longest over where the optimizer state lives, its dtypes and the lean norms: the flags
        longest, longest_setup = longest_over_settings(args.longest_seq, machine, setup)
        if args.json:
            found_keys = asdict(found) | _step_keys(args.longest_seq, found, setup, args.tflops)
            other_keys = asdict(alternative) | _step_keys(args.longest_seq, alternative, other, args.tflops)
            flags = _setup_flags(longest_setup)
            longest_keys = asdict(longest) | {"setup": asdict(longest_setup), "flags": flags}
            keys = found_keys | {"setup": asdict(setup), f"{label}_cpu_checkpointing": other_keys}
            print(json.dumps(keys | {"longest_over_settings": longest_keys}))
        else:
            print(found.reason + _step_text(args.longest_seq, found, setup, args.tflops))
            text = _step_text(args.longest_seq, alternative, other, args.tflops)
            print(f"{label} cpu_checkpointing: {alternative.reason}{text}")
            if longest.seq_len > max(found.seq_len, alternative.seq_len):
                asked = " ".join(_setup_flags(longest_setup))
                print(f"longest over the settings: {longest.seq_len} tokens, with {asked}")
        return 0 if found.seq_len else 1
    if args.gpt is not None:
        n_embd, n_head, n_layer = args.gpt
        try:
            config = GPTConfig(n_embd=n_embd, n_head=n_head, n_layer=n_layer)
        except ValueError as error:
            parser.error(f"--gpt: {error}")
        fit = fit_gpt(config, machine, work, **options)
        print(json.dumps(asdict(fit)) if args.json else fit.reason)
        return 0 if fit.fits else 1
    best, too_big = largest_gpt(gpt_family(), machine, work, **options)
    if args.json:
        print(json.dumps({"largest": best and asdict(best), "next": too_big and asdict(too_big)}))
    else:
        print(_line(best, "largest that fits"))
        print(_line(too_big, "next size up"))
    return 0 if best is not None else 1
