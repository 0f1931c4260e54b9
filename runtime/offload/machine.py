"""The two edges of the pure plan (plan.py): the facts it is made from, and the ranks' agreement on it.

`read_facts` reads, once, what the plan needs to know about this rank: the stage's dtypes and layouts,
where the working weights live, and the machine (ranks on this host, host memory left to this process, a
GPU's free memory). `agree` then makes every rank run the same plan: each rank planned from its own
reading of its own host, and ranks that read later see what earlier ones allocated, while one rank
landing 16-bit gradients or stepping on the CPU would set the pace of all of them anyway, and every
shard must take the same arithmetic. Both votes are `Comm.count` collectives, landing first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from runtime.comm import Comm
from runtime.distributed import local_world_size
from runtime.host_memory import can_pin
from runtime.memory import host_available_bytes
from runtime.offload.io.targets import WorkingTarget
from runtime.offload.plan import LandingChoice, MachineFacts, OffloadFacts, OffloadPlan, UpdateChoice
from runtime.zero import StageGroups
from runtime.zero.buckets import bucket_order
from runtime.zero.flat import FlatGroup


def read_facts(
    groups: Sequence[FlatGroup],
    zero: StageGroups,
    comm: Comm,
    device: torch.device,
    *,
    registration: dict[nn.Parameter, int],
    target: WorkingTarget,
) -> OffloadFacts:
    """This rank's facts (see `OffloadFacts`), read now."""
    return OffloadFacts(
        grad_dtype=zero.grad_pieces()[0][0].dtype,
        master_dtype=groups[0].master.dtype if groups else torch.float32,
        layouts=tuple(g.layout for g in groups),
        order=tuple(bucket_order(groups, registration)),
        weights_on_host=target.on_host,
        sharded_stage=zero.params_sharded,
        world_size=comm.world_size,
        machine=read_machine(device),
    )


def read_machine(device: torch.device) -> MachineFacts:
    """This machine as the plan sees it from a rank training on `device`: the ranks on this host (from
    whichever launcher started them), the host memory left to this process, the GPU's free memory."""
    on_gpu = device.type == "cuda"
    return MachineFacts(
        on_gpu=on_gpu,
        can_pin=can_pin(device),
        local_ranks=local_world_size(),
        host_available=host_available_bytes(),
        device_free=torch.cuda.mem_get_info(device)[0] if on_gpu else None,
    )


def agree(plan: OffloadPlan, grad_dtype: torch.dtype, comm: Comm, device: torch.device) -> OffloadPlan:
    """`plan` with the landing and the update site every rank takes."""
    landing = agree_on_landing(plan.landing, grad_dtype, comm, device)
    update = agree_on_update(plan.update, comm, device)
    return replace(plan, landing=landing, update=update)


def agree_on_landing(
    choice: LandingChoice, grad_dtype: torch.dtype, comm: Comm, device: torch.device
) -> LandingChoice:
    """The landing every rank uses: fp32 only where all ranks chose it."""
    wide = comm.count(choice.dtype != grad_dtype, device)
    if wide in (0, comm.world_size):
        return choice
    native = str(grad_dtype).removeprefix("torch.")
    return LandingChoice(
        grad_dtype,
        f"gradients land as {native}: {comm.world_size - wide} of {comm.world_size} ranks have "
        "no room for fp32 landing on their host",
    )


def agree_on_update(choice: UpdateChoice, comm: Comm, device: torch.device) -> UpdateChoice:
    """The update site every rank uses: the device only where all ranks chose it, so every shard takes
    the same arithmetic and no rank waits on a slower one's host."""
    on_device = comm.count(choice.on_device, device)
    if on_device in (0, comm.world_size):
        return choice
    return UpdateChoice(
        False,
        f"the CPU runs the Adam step: {comm.world_size - on_device} of {comm.world_size} ranks cannot "
        "stream the state through their GPU",
    )
