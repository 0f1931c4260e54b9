"""dslaunch's training runtime: ZeRO partitioning, CPU offload and mixed precision on torch.distributed.

User scripts ``import runtime`` where they would ``import deepspeed``::

    parser = runtime.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args()
    engine, optimizer, loader, scheduler = runtime.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset)
    for batch in loader:
        loss = loss_fn(engine(batch["x"].to(engine.device)), ...)
        engine.backward(loss)
        engine.step()
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runtime import checkpointing
from runtime.distributed import current_device, init_distributed
from runtime.engine import Engine, MemoryBreakdown
from runtime.engine.setup_oom import explained_setup_oom
from runtime.errors import UserError, install_excepthook
from runtime.memory import see_memory_usage
from runtime.parallel.plan import build_parallel_plan

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "MemoryBreakdown",
    "UserError",
    "__version__",
    "add_config_arguments",
    "checkpointing",
    "init_distributed",
    "initialize",
    "see_memory_usage",
]

# An uncaught UserError ends a worker as one line plus a hint and exit code 2 (runtime.errors).
install_excepthook()

LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's runtime flags: --deepspeed, --deepspeed_config, --deepspeed_activation_checkpointing
    (and the old --deepscale names), and --local_rank / --local-rank, which launchers pass to every worker
    (dslaunch and DeepSpeed's launcher as --local_rank=N, torch.distributed.launch as --local-rank=N).

    A script that declares its own --local_rank keeps it, whether it adds it before or after this call:
    ours then steps aside (the parser resolves that one conflict in favour of the later declaration).
    """
    group = parser.add_argument_group("runtime", "dslaunch runtime (DeepSpeed-compatible flags)")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="enable the runtime (no effect)"
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="path to the runtime JSON/YAML config"
    )
    group.add_argument(
        "--deepspeed_activation_checkpointing",
        default=False,
        action="store_true",
        help="checkpoint activations (the script picks the blocks; runtime.activation_checkpointing)",
    )
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    _add_local_rank(parser, group)
    return parser


def _add_local_rank(parser: argparse.ArgumentParser, group: argparse._ArgumentGroup) -> None:
    declared = {s for action in parser._actions for s in action.option_strings}
    missing = [flag for flag in LOCAL_RANK_FLAGS if flag not in declared]
    if not missing:
        return
    # default=SUPPRESS on the action and the -1 as a parser default: a script's own --local_rank, added
    # later, then supplies the default (argparse reads action defaults before parser defaults).
    if not any(action.dest == "local_rank" for action in parser._actions):
        parser._defaults.setdefault("local_rank", -1)  # not set_defaults: that rewrites existing actions
    group.add_argument(
        *missing,
        dest="local_rank",
        type=int,
        default=argparse.SUPPRESS,
        help="this worker's rank on its node, passed by launchers (the runtime reads LOCAL_RANK)",
    )
    # a script that adds --local_rank after this call replaces ours instead of failing with a conflict
    # (each argument group checks conflicts with its own handler; later groups copy the parser's)
    for container in (parser, *parser._action_groups):
        container.conflict_handler = "resolve"


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    model_parameters: Any = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    config: Any = None,
    collate_fn: Callable[..., Any] | None = None,
    dist_init_required: bool | None = None,
    config_params: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
) -> tuple[Engine, Any, torch.utils.data.DataLoader | None, Any]:
    """Build the engine, like ``deepspeed.initialize``.

    Args:
        args: parsed arguments; ``args.deepspeed_config`` names the config when ``config`` is None.
        model: the model (moved to this rank's device, weights cast to the working dtype).
        optimizer: a torch optimizer (rebuilt over the fp32 master shards with the same class, defaults and
            group options; its state is not carried over), or a callable ``param_groups -> optimizer``.
            None: the config's "optimizer" section.
        model_parameters: parameters or torch param-group dicts to train (default: all trainable).
        training_data: a dataset; returns a DataLoader with a DistributedSampler and the micro batch size
            (over the data-parallel ranks with pipeline or tensor parallelism; a pipeline's is DeepSpeed's:
            in order, and train_batch() / eval_batch() read it when given no iterator).
        lr_scheduler: a scheduler object or a callable ``optimizer -> scheduler``; None: the config's.
        config: a dict, a .json/.yaml path, or an already loaded ``runtime.config.Config``.
        collate_fn: passed to the DataLoader.
        dist_init_required: False to forbid creating the process group here (it must exist then).
        config_params, distributed_port: DeepSpeed's keywords; see runtime.deepspeed_api.initialize.
        mpu: a Megatron-style model-parallel unit (runtime.parallel.mpu): ZeRO partitions and reduces over
            its data-parallel group, the gradient norm also sums over its model-parallel group, and
            train_batch_size counts data-parallel ranks. A runtime.parallel.ParallelGrid is one.

    Returns:
        (engine, optimizer, dataloader or None, lr_scheduler or None). The optimizer is the torch optimizer
        over the master shards: read or set its lr, but call engine.step(), not optimizer.step().
    """
    from runtime.deepspeed_api.initialize import deepspeed_keywords
    from runtime.initialize_args import check_arguments, config_source

    model_parameters = check_arguments(model, optimizer, model_parameters, training_data, lr_scheduler)
    assert model is not None  # check_arguments refused None
    from runtime.compile import compiled_in_place, unwrap_compiled

    model, compiler = unwrap_compiled(model)  # torch.compile(model) given: the engine compiles it its way
    source = deepspeed_keywords(config_source(args, config, config_params), None, distributed_port)
    if not dist.is_initialized() and dist_init_required is False:
        raise RuntimeError(
            "dist_init_required=False but no process group exists; call runtime.init_distributed()"
        )
    init_distributed()  # the group, or for one the script made, only the care its exit needs
    if mpu is not None:
        from runtime.deepspeed_api.initialize import check_mpu_model

        check_mpu_model(model, mpu)
    from runtime.pipe.module import PipelineModule

    # the parallel plan, built once with the config loaded for the data-parallel size: a pipeline's is the
    # grid its module was built on; any other model's comes from the mpu or AutoTP (applied to the model
    # where asked), or is the trivial plan
    engine_class: type[Engine] = Engine
    if isinstance(model, PipelineModule):
        from runtime.parallel.pipe_plan import build_pipeline_plan
        from runtime.pipe.engine import PipelineEngine

        plan, cfg = build_pipeline_plan(model, source)
        engine_class = PipelineEngine
    else:
        plan, cfg = build_parallel_plan(model, source, mpu=mpu)
    # out of GPU memory while it is built, the engine says what would fit (runtime/engine/setup_oom.py)
    ranks = plan.comm.world_size if plan.comm is not None else dist.get_world_size()
    with explained_setup_oom(model, cfg, ranks, current_device()):
        engine = engine_class(
            model,
            cfg,
            optimizer=optimizer,
            model_parameters=model_parameters,
            lr_scheduler=lr_scheduler,
            parallel=plan,
        )
    if compiled_in_place(model) and engine.zero.params_sharded and engine.comm.rank == 0:
        logging.getLogger("runtime.compile").warning(
            "the model was compiled in place (model.compile()) before initialize: at ZeRO-3 dynamo gives "
            "up on every frame that runs a gather hook, so only the layers below them run compiled; call "
            "engine.compile() after initialize instead (each gather unit compiled, the hooks outside)"
        )
    if compiler is not None:
        engine._compile_module(
            {}, compiler, "the model came torch.compile'd, so the engine compiled it with that compiler"
        )
    loader = None
    if training_data is not None:
        loader = _dataloader(engine, training_data, collate_fn)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _dataloader(
    engine: Engine, dataset: torch.utils.data.Dataset, collate_fn: Callable[..., Any] | None
) -> torch.utils.data.DataLoader:
    """The loader of `training_data` for a pipeline (DeepSpeed's: in order, over the grid's data ranks,
    read by train_batch() / eval_batch() without an iterator) or any other engine (over the plan's data
    ranks: the model ranks of one data rank read the same samples)."""
    from runtime.pipe.engine import PipelineEngine

    if isinstance(engine, PipelineEngine):
        from runtime.pipe.data import pipeline_dataloader

        loader = pipeline_dataloader(dataset, engine.config, engine.grid, collate_fn=collate_fn)
        engine.set_dataloader(loader)
        return loader
    replicas, rank = engine.parallel.data_ranks() or (None, None)
    loader = build_dataloader(dataset, engine.config, collate_fn=collate_fn, replicas=replicas, rank=rank)
    engine.training_dataloader = loader
    return loader


def build_dataloader(
    dataset: torch.utils.data.Dataset,
    config: Any,
    *,
    collate_fn: Callable[..., Any] | None = None,
    replicas: int | None = None,
    rank: int | None = None,
) -> torch.utils.data.DataLoader:
    """A DataLoader over this rank's part of `dataset` (DistributedSampler, shuffled, seed 0) with the
    micro batch size. Call ``loader.sampler.set_epoch(epoch)`` each epoch for a new order. `replicas` and
    `rank`: the data-parallel ranks and this one's place (default: the world; model-parallel ranks of one
    data rank read the same samples)."""
    from runtime.checkpoint.data_position import ResumableDataLoader, ResumableSampler

    sampler = ResumableSampler(
        dataset,
        num_replicas=dist.get_world_size() if replicas is None else replicas,
        rank=dist.get_rank() if rank is None else rank,
        drop_last=config.dataloader_drop_last,
    )
    return ResumableDataLoader(
        dataset,
        batch_size=config.train_micro_batch_size_per_gpu,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=config.dataloader_drop_last,
    )
