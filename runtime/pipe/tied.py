"""Weights tied across pipeline stages: one process group per tie, equal copies, summed gradients.

A tie key held by stages S = [s0, s1, ...] gets, for every data (and model) coordinate, a group of the
ranks at stages S of that pipeline. The copies start equal (the lowest stage's values are broadcast) and
stay equal because each step sums their gradients over the group before anything else reads them. The
lowest stage owns the tie for the gradient norm: the other stages' copies are duplicates, whose squares
are taken out of the norm so the weight is counted once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from runtime.pipe.module import PipelineModule


@dataclass
class Tie:
    key: str
    stages: list[int]
    group: dist.ProcessGroup
    src: int  # global rank of the owning (lowest) stage in this rank's group
    params: list[nn.Parameter]  # this stage's copies
    is_owner: bool


def build_ties(module: PipelineModule) -> list[Tie]:
    """The ties this rank takes part in; every rank must call it (groups are created collectively)."""
    topology = module.topology()
    me = dist.get_rank()
    ties = []
    for key, stages in sorted(module.tied_keys_by_stage().items()):
        if len(stages) < 2:
            continue  # one stage holds every use: a plain shared module
        mine = None
        for pipeline in topology.get_axis_comm_lists("pipe") or [list(range(topology.world_size()))]:
            ranks = [pipeline[s] for s in stages]
            group = dist.new_group(ranks)
            if me in ranks:
                mine = (group, ranks[0])
        if mine is None or module.stage_id not in stages:
            continue
        ties.append(
            Tie(
                key=key,
                stages=stages,
                group=mine[0],
                src=mine[1],
                params=module.tied_parameters(key),
                is_owner=module.stage_id == stages[0],
            )
        )
    return ties


def broadcast_tied_weights(ties: list[Tie], device: torch.device) -> None:
    """Make every copy equal to the owning stage's (before the engine copies weights into its buffers)."""
    with torch.no_grad():
        for tie in ties:
            for param in tie.params:
                data = param.data.to(device)
                dist.broadcast(data, tie.src, group=tie.group)
                param.data.copy_(data)


def all_reduce_tied_grads(ties: list[Tie]) -> None:
    """Sum each tied weight's gradient over the stages holding it (in place, in the engine's buffers)."""
    for tie in ties:
        for param in tie.params:
            if param.grad is not None:
                dist.all_reduce(param.grad, group=tie.group)


def duplicate_grad_squares(
    ties: list[Tie], *, dp_group: dist.ProcessGroup | None, dp_size: int, scale: float, device: torch.device
) -> torch.Tensor | None:
    """Sum of squares of the data-parallel-summed gradients of the copies this stage does not own (what the
    norm must not count twice), in the units of the engine's reduced gradients; None when there are none."""
    grads = [p.grad for tie in ties if not tie.is_owner for p in tie.params]
    copies = [grad.detach().reshape(-1).float() for grad in grads if grad is not None]
    if not copies:
        return None
    flat = torch.cat(copies).mul_(scale)
    if dp_size > 1:
        dist.all_reduce(flat, group=dp_group)
    return flat.square().sum().to(device)


__all__ = ["Tie", "all_reduce_tied_grads", "broadcast_tied_weights", "build_ties", "duplicate_grad_squares"]
