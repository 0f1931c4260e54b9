"""DeepSpeed's functional communication API (``deepspeed.comm``) as a thin layer over torch.distributed.

DeepSpeed scripts call ``deepspeed.comm.init_distributed()``, ``get_rank()``, ``all_reduce(t)`` and so
on as module functions. Each one here is the torch.distributed call of the same name: no second
implementation, no extra buffers. What DeepSpeed adds on top is accepted and mapped:

- ``init_distributed`` creates the group from the environment through `runtime.distributed` (the same
  path `runtime.initialize` takes), whoever started the process; ``auto_mpi_discovery`` is accepted
  (the rank layout is read from Open MPI / MPICH / Slurm variables anyway), ``distributed_port`` fills
  MASTER_PORT when the launcher did not;
- the communication logger's keyword arguments (``prof``, ``log_name``, ``debug``) are accepted and
  ignored: dslaunch counts bytes per collective in `runtime.comm.Comm` instead;
- ``allgather_fn`` / ``reduce_scatter_fn`` are DeepSpeed's flat-tensor helpers (output and input in one
  call, ``*_into_tensor`` where the backend has it).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from runtime.activation_checkpointing import configured_mpu
from runtime.distributed import init_distributed as _init_from_env
from runtime.distributed import resolve_dist_env
from runtime.parallel.grid import ParallelGrid
from runtime.parallel.mpu import read_mpu

__all__ = [
    "ProcessGroup",
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "get_all_ranks_from_group",
    "get_backend",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]

_LOGGER_KWARGS = ("prof", "log_name", "debug")


def _plain(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drop DeepSpeed's communication-logger keywords, which torch's functions do not take."""
    return {k: v for k, v in kwargs.items() if k not in _LOGGER_KWARGS}


# -- the group ------------------------------------------------------------------------------------------
def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Create the default process group, like ``deepspeed.comm.init_distributed``; a no-op when it exists.

    The rank layout comes from the environment (dslaunch, torchrun, Slurm, mpirun) unless `rank` and
    `world_size` are given with an `init_method`. `dist_init_required=False` only checks that a group
    exists.
    """
    if dist.is_initialized():
        _init_from_env(dist_backend)  # the existing group: only the care its exit needs
        return
    if dist_init_required is False:
        raise RuntimeError("init_distributed(dist_init_required=False), but no process group exists")
    if init_method is not None and rank >= 0 and world_size >= 1:
        backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, **kwargs)
        _init_from_env(backend)
        return
    env = resolve_dist_env(os.environ)
    if env.world_size > 1 and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(distributed_port)
    _init_from_env(dist_backend, timeout=timeout)
    _tell_accelerate_the_cpu_backend(dist_backend)


def _tell_accelerate_the_cpu_backend(requested: str | None) -> None:
    """Let Accelerate count the CPU workers of a DeepSpeed run.

    Accelerate (1.x) picks its backend before it asks DeepSpeed for the process group, from
    ``torch.accelerator.current_accelerator()``; a CPU-only process has none, so its backend stays None,
    and after ``init_distributed`` returns it concludes "no distributed training": num_processes = 1 and
    process_index = 0 on every rank (each rank would train alone on the whole data set). Its ``cpu=True``
    path would count the ranks but turns DeepSpeed off. So when Accelerate is the caller (it passes
    ``dist_backend=None`` from inside ``PartialState.__init__``, whose state is one shared dict) and the
    group we just made is gloo on CPU, record that backend in its shared state before it reads it.
    """
    state_module = sys.modules.get("accelerate.state")
    if requested is not None or state_module is None or torch.cuda.is_available():
        return
    shared = getattr(getattr(state_module, "PartialState", None), "_shared_state", None)
    if isinstance(shared, dict) and "backend" in shared and shared["backend"] is None:
        shared["backend"] = get_backend()


def is_initialized() -> bool:
    initialized = dist.is_available() and dist.is_initialized()
    if initialized:
        # A second Accelerate state in one process (each TrainingArguments resets it: a second Trainer)
        # asks this instead of calling init_distributed once the group exists; hand it the backend too.
        _tell_accelerate_the_cpu_backend(None)
    return initialized


def is_available() -> bool:
    return dist.is_available()


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    dist.destroy_process_group(group)


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> ProcessGroup:
    return dist.new_group(ranks, **kwargs)


def get_world_group() -> ProcessGroup | None:
    return dist.group.WORLD  # None until the process group exists, as torch answers


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in `group`; 0 when no group exists (as DeepSpeed's scripts expect)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Ranks in `group`; 1 when no group exists."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """LOCAL_RANK of this process (from the launcher's environment; 0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: ProcessGroup | None = None) -> list[int]:
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)


def get_backend(group: ProcessGroup | None = None) -> str:
    return str(dist.get_backend(group))


# -- collectives: torch's, with DeepSpeed's extra keywords dropped -----------------------------------------
def barrier(
    group: ProcessGroup | None = None, async_op: bool = False, device_ids: Any = None, **kw: Any
) -> Any:
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(
    group: ProcessGroup | None = None, timeout: timedelta | None = None, wait_all_ranks: bool = False
) -> Any:
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    **kw: Any,
) -> Any:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def inference_all_reduce(
    tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM, group: ProcessGroup | None = None, **kw: Any
) -> Any:
    return dist.all_reduce(tensor, op=op, group=group)


def all_reduce_coalesced(
    tensors: list[torch.Tensor], op: ReduceOp.RedOpType = ReduceOp.SUM, group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:  # fmt: skip
    works = [dist.all_reduce(t, op=op, group=group, async_op=async_op) for t in tensors]
    return works[-1] if works else None


def broadcast(
    tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, async_op: bool = False, **kw: Any
) -> Any:
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def broadcast_object_list(object_list: list[Any], src: int = 0, group: ProcessGroup | None = None) -> None:
    dist.broadcast_object_list(object_list, src=src, group=group)


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    **kw: Any,
) -> Any:
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    **kw: Any,
) -> Any:
    return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def allgather_fn(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup | None = None,
    async_op: bool = False, debug: Any = None,
) -> Any:  # fmt: skip
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    **kw: Any,
) -> Any:
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    **kw: Any,
) -> Any:
    return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_fn(
    output_tensor: torch.Tensor, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None, async_op: bool = False, prof: bool = False, debug: Any = None,
) -> Any:  # fmt: skip
    """DeepSpeed's flat reduce-scatter. gloo has no reduce_scatter_tensor: there it is an all-reduce of the
    whole input followed by a copy of this rank's chunk (what `runtime.comm.Comm` falls back to as well)."""
    if get_backend(group) == "gloo":
        work = dist.all_reduce(tensor, op=op, group=group)
        chunk = output_tensor.numel()
        output_tensor.copy_(tensor.view(-1).narrow(0, get_rank(group) * chunk, chunk).view_as(output_tensor))
        return work
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    **kw: Any,
) -> Any:
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    **kw: Any,
) -> Any:
    return dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    **kw: Any,
) -> Any:
    return dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    **kw: Any,
) -> Any:
    return dist.all_to_all_single(
        output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op
    )


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0, **kw: Any) -> None:
    dist.send(tensor, dst, group=group, tag=tag)


def recv(
    tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, **kw: Any
) -> int:
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0, **kw: Any) -> Any:
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(
    tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, **kw: Any
) -> Any:
    return dist.irecv(tensor, src, group=group, tag=tag)


def log_summary(show_straggler: bool = False) -> None:
    """DeepSpeed's communication-logger summary. dslaunch has no communication logger (its engines count
    bytes per collective in ``engine.comm.counter``); say so rather than print nothing."""
    from runtime.deepspeed_api.utils import logger

    if get_rank() == 0:
        logger.info(
            "deepspeed.comm.log_summary: dslaunch has no communication logger; bytes per collective are "
            "in engine.comm.counter"
        )


# -- deepspeed.utils.groups: the data- and model-parallel groups; no expert/sequence groups ---------------
def _model_parallel() -> Any:
    """The engine's model-parallel groups (``initialize(mpu=...)``, AutoTP's grid or a pipeline's, which
    hand their mpu to runtime.activation_checkpointing; the engine checked it), or None with data
    parallelism alone: the world is then the data group."""
    mpu = configured_mpu()
    return None if mpu is None else read_mpu(mpu)


def _get_data_parallel_group() -> ProcessGroup | None:
    groups = _model_parallel()
    return dist.group.WORLD if groups is None else groups.data_group


def _get_data_parallel_world_size() -> int:
    groups = _model_parallel()
    return get_world_size() if groups is None else groups.data_size


def _get_data_parallel_rank() -> int:
    groups = _model_parallel()
    return get_rank() if groups is None else groups.data_rank


def _get_model_parallel_world_size() -> int:
    """DeepSpeed's answer: the mpu's model-parallel size. A pipeline's grid counts every rank of one
    data-parallel replica there (its stages x its tensor shards), as DeepSpeed's grid does; the grid's own
    get_model_parallel_world_size() is the tensor axis alone, Megatron's meaning, which the engines use."""
    mpu = configured_mpu()
    if isinstance(mpu, ParallelGrid):
        return mpu.pipe_parallel_size * mpu.model_parallel_size
    groups = _model_parallel()
    return 1 if groups is None else groups.model_size


def _no_group(kind: str, alternative: str) -> Any:
    from runtime.deepspeed_api.unsupported import unsupported

    unsupported(f"{kind} process groups", alternative)


def _get_expert_parallel_group(group_name: str = "") -> ProcessGroup:
    return _no_group("expert-parallel (MoE)", "dslaunch has no MoE layers; train a dense model")


def _sequence_groups() -> Any:
    """The Ulysses groups built in this process (HF Trainer reads them back here), or a refusal."""
    from runtime.sequence.sp_groups import current_sequence_groups

    groups = current_sequence_groups()
    if groups is None:
        _no_group("sequence-parallel (Ulysses)", "train with data parallelism and ZeRO")
    return groups


def _get_sequence_parallel_group() -> ProcessGroup:
    return _sequence_groups().get_sequence_parallel_group()


def _get_sequence_parallel_world_size() -> int:
    return _sequence_groups().get_sequence_parallel_world_size()


def _get_sequence_parallel_rank() -> int:
    return _sequence_groups().get_sequence_parallel_rank()
