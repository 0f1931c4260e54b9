"""What a person runs to see a memory estimate: the ``ds_estimate`` command line, the text table, and
DeepSpeed's ``estimate_zero{2,3}_model_states_mem_needs*`` functions.

The numbers all come from ``runtime.estimator.model_states``; this module only chooses which
configurations to show (every stage and offload choice by default) and formats them, in GiB as a table or
as JSON. DeepSpeed's names are kept so a notebook written against ``deepspeed.runtime.zero`` runs with
only its import changed; they return our numbers, not DeepSpeed's.

Command line (console script ``ds_estimate``, or ``python -m runtime.estimator``):

    python -m runtime.estimator --params 1.5e9 --num_gpus 8 --num_nodes 1
    python -m runtime.estimator --model_size xl --num_gpus 8 --num_nodes 2
    python -m runtime.estimator --model_size xl --num_gpus 8 --pipeline_parallel 2 --tensor_parallel 2
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict

from torch import nn

from runtime.estimator.fit import gpt_sizes
from runtime.estimator.fit_cli import fit_options, llama_shape, run_fit
from runtime.estimator.model_states import (
    DEFAULT_BUCKET,
    DTYPE_BYTES,
    OPTIMIZER_BYTES,
    Estimate,
    ModelSizes,
    estimate,
    estimate_all,
    model_sizes,
)
from runtime.models.gpt import MODEL_SIZES, GPTConfig

__all__ = [
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "format_table",
    "main",
]

GIB = float(1 << 30)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def format_table(
    estimates: Sequence[Estimate], sizes: ModelSizes, dtype: str = "bf16", master_dtype: str = "fp32"
) -> str:
    """A plain-text table of `estimates`, with a header naming the model and the cluster."""
    if not estimates:
        return "no configuration to estimate"
    first = estimates[0]
    largest = (
        f", largest layer {sizes.largest_layer_params / 1e6:.1f}M"
        if sizes.largest_layer_params is not None
        else " (stage 3 needs --largest_layer_params)"
    )
    pp, tp = first.pipeline_parallel, first.tensor_parallel
    grid = ""
    if pp * tp > 1:
        data = first.gpus_per_node * first.num_nodes // (pp * tp)
        grid = f"; pipeline {pp} x tensor {tp} x data {data}: a GPU holds (replicated + sharded/{tp}) / {pp}"
    lines = [
        f"Model states of {sizes.total_params / 1e9:.3f}B parameters{largest}; {dtype} weights, "
        f"{master_dtype} master weights; {first.gpus_per_node} GPU(s) per node x {first.num_nodes} "
        f"node(s){grid}",
        "Not included: activations, CUDA context, allocator fragmentation.",
        "per host = host memory of all local ranks: offloaded states, or the fp32 model each process builds",
        "before moving it to its GPU (none under zero.Init at stage 3), whichever is larger.",
        "",
        f"{'stage':<6}{'offload_optimizer':<19}{'offload_param':<15}{'per GPU':>12}{'(transient)':>14}"
        f"{'per host':>13}",
    ]
    for e in estimates:
        lines.append(
            f"{e.stage:<6}{'cpu' if e.offload_optimizer else 'none':<19}"
            f"{'cpu' if e.offload_param else 'none':<15}{_gib(e.per_gpu_bytes):>12}"
            f"{'(' + _gib(e.gpu_transient) + ')':>14}{_gib(e.per_host_bytes):>13}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed's function names (deepspeed.runtime.zero.stage_1_and_2 / stage3), returning our numbers.


def estimate_zero2_model_states_mem_needs(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """(host bytes per node x additional_buffer_factor, bytes per GPU) of ZeRO-2, like DeepSpeed's."""
    e = estimate(
        total_params,
        stage=2,
        num_gpus_per_node=num_gpus_per_node,
        num_nodes=num_nodes,
        offload_optimizer=cpu_offload,
    )
    return int(e.per_host_bytes * additional_buffer_factor), e.per_gpu_bytes


def estimate_zero3_model_states_mem_needs(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """(host bytes per node x factor, bytes per GPU, largest layer's transient bytes) of ZeRO-3."""
    sizes = ModelSizes(int(total_params), int(largest_layer_params))
    e = estimate(
        sizes,
        stage=3,
        num_gpus_per_node=num_gpus_per_node,
        num_nodes=num_nodes,
        offload_optimizer=cpu_offload,
        offload_param=cpu_offload and cpu_offload_params,
        zero_init=zero_init,
    )
    return int(e.per_host_bytes * additional_buffer_factor), e.per_gpu_bytes, e.gpu_transient


def _print_stage(sizes: ModelSizes, stage: int, gpus: int, nodes: int) -> list[Estimate]:
    estimates = estimate_all(sizes, num_gpus_per_node=gpus, num_nodes=nodes, stages=(stage,))
    print(format_table(estimates, sizes))
    return estimates


def estimate_zero2_model_states_mem_needs_all_live(
    model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1
) -> list[Estimate]:
    """Print and return the stage-2 estimates (with and without offload) for `model`."""
    return _print_stage(model_sizes(model), 2, num_gpus_per_node, num_nodes)


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1
) -> list[Estimate]:
    """Print and return the stage-2 estimates for a parameter count (no model needed)."""
    return _print_stage(ModelSizes(int(total_params)), 2, num_gpus_per_node, num_nodes)


def estimate_zero3_model_states_mem_needs_all_live(
    model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1
) -> list[Estimate]:
    """Print and return the stage-3 estimates (no offload, optimizer offload, full offload) for `model`."""
    return _print_stage(model_sizes(model), 3, num_gpus_per_node, num_nodes)


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1
) -> list[Estimate]:
    """Print and return the stage-3 estimates for parameter counts (no model needed)."""
    sizes = ModelSizes(int(total_params), int(largest_layer_params))
    return _print_stage(sizes, 3, num_gpus_per_node, num_nodes)


# ---------------------------------------------------------------------------------------------------------
# Command line


def _gpt_sizes(name: str) -> ModelSizes:
    """Sizes of a runtime.models.gpt size, from its config (nothing is allocated)."""
    return gpt_sizes(GPTConfig.named(name))


def _gpt_shape(text: str) -> tuple[int, int, int]:
    try:
        n_embd, n_head, n_layer = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected n_embd:n_head:n_layer such as 5120:40:48, got {text!r}"
        ) from None
    return n_embd, n_head, n_layer


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 1.5e9, got {text!r}") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    """``ds_estimate``: print the memory table; exit code 0, or 2 for bad arguments."""
    parser = argparse.ArgumentParser(
        prog="ds_estimate",
        description="Estimate per-GPU and per-host memory of a ZeRO run's model states "
        "(weights, gradients, master weights, optimizer state) for every stage and offload choice.",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_number, help="total parameter count, e.g. 1.5e9")
    what.add_argument(
        "--model_size", help=f"a runtime.models.gpt size: {', '.join(MODEL_SIZES)} (or gpt2, gpt2-xl, ...)"
    )
    what.add_argument(
        "--largest",
        action="store_true",
        help="the largest GPT that trains on a machine of --gpu_memory and --host_memory (GiB), with "
        "everything a step needs, not only model states (runtime.estimator.fit)",
    )
    what.add_argument(
        "--gpt", type=_gpt_shape, help="does this GPT (n_embd:n_head:n_layer) train on the machine"
    )
    what.add_argument(
        "--longest_seq",
        type=llama_shape,
        metavar="1b|8b|H:I:L:HEADS:KV:VOCAB",
        help="the longest sequence this Llama-shaped model trains on the machine, with the tiled MLP and "
        "loss and CPU activation checkpoints (runtime.estimator.longest)",
    )
    parser.add_argument(
        "--largest_layer_params", type=_number, help="the largest layer's parameter count (for stage 3)"
    )
    parser.add_argument("--num_gpus", type=_count, default=1, help="GPUs per node")
    parser.add_argument("--num_nodes", type=_count, default=1, help="number of nodes")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="working weights")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_BYTES), default="adam")
    parser.add_argument(
        "--bf16_master_weights",
        action="store_true",
        help="bf16.bf16_master_weights_and_grads: 2-byte masters (stages 1-3)",
    )
    parser.add_argument(
        "--bf16_optimizer_states",
        action="store_true",
        help="bf16.bf16_optimizer_states: half the optimizer state (with --bf16_master_weights)",
    )
    parser.add_argument(
        "--reduce_bucket_size", type=_count, default=DEFAULT_BUCKET, help="elements per reduce bucket"
    )
    parser.add_argument("--stages", default="0,1,2,3", help="comma-separated stages to show")
    parser.add_argument("--pipeline_parallel", type=_count, default=1, help="pipeline stages")
    parser.add_argument("--tensor_parallel", type=_count, default=1, help="tensor-parallel (AutoTP) degree")
    parser.add_argument(
        "--tensor_parallel_params",
        type=_number,
        help="with --params: the parameters tensor parallelism shards (attention and MLP projections)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    fit_options(parser)
    args = parser.parse_args(argv)
    if args.largest or args.gpt is not None or args.longest_seq is not None:
        return run_fit(parser, args)
    try:
        stages = tuple(int(s) for s in args.stages.split(","))
        if any(s not in (0, 1, 2, 3) for s in stages):
            raise ValueError
    except ValueError:
        parser.error(f"--stages: expected stages 0-3 separated by commas, got {args.stages!r}")
    if args.model_size is not None:
        try:
            sizes = _gpt_sizes(args.model_size)
        except ValueError as error:
            parser.error(f"--model_size: {error}")
        if args.largest_layer_params is not None:
            sizes = ModelSizes(sizes.total_params, int(args.largest_layer_params))
    else:
        largest = None if args.largest_layer_params is None else int(args.largest_layer_params)
        if largest is not None and largest > args.params:
            parser.error("--largest_layer_params is larger than --params")
        sharded = None if args.tensor_parallel_params is None else int(args.tensor_parallel_params)
        if sharded is not None and sharded > args.params:
            parser.error("--tensor_parallel_params is larger than --params")
        if args.tensor_parallel > 1 and sharded is None:
            parser.error("--tensor_parallel with --params needs --tensor_parallel_params (what it shards)")
        sizes = ModelSizes(int(args.params), largest, tensor_parallel_params=sharded)
    ranks = args.num_gpus * args.num_nodes
    if ranks % (args.pipeline_parallel * args.tensor_parallel):
        parser.error(
            f"--pipeline_parallel {args.pipeline_parallel} x --tensor_parallel {args.tensor_parallel} does "
            f"not divide the {ranks} GPU(s)"
        )
    estimates = estimate_all(
        sizes,
        num_gpus_per_node=args.num_gpus,
        num_nodes=args.num_nodes,
        stages=stages,
        dtype=args.dtype,
        optimizer=args.optimizer,
        reduce_bucket_size=args.reduce_bucket_size,
        pipeline_parallel=args.pipeline_parallel,
        tensor_parallel=args.tensor_parallel,
        **_state_dtypes(parser, args),
    )
    if args.json:
        print(
            json.dumps(
                {"model": asdict(sizes) | {"numels": None}, "estimates": [e.to_dict() for e in estimates]}
            )
        )
    else:
        masters = "bf16" if args.bf16_master_weights else "fp32"
        print(format_table(estimates, sizes, args.dtype, masters))
    return 0


def _state_dtypes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """estimate()'s master_dtype/state_dtype from the two bf16 flags (refused where the config is)."""
    if args.bf16_optimizer_states and not args.bf16_master_weights:
        parser.error("--bf16_optimizer_states needs --bf16_master_weights (as bf16.bf16_optimizer_states)")
    if args.bf16_master_weights and args.dtype != "bf16":
        parser.error("--bf16_master_weights needs --dtype bf16 (as bf16.bf16_master_weights_and_grads)")
    return {
        "master_dtype": "bf16" if args.bf16_master_weights else "fp32",
        "state_dtype": "bf16" if args.bf16_optimizer_states else "fp32",
    }
