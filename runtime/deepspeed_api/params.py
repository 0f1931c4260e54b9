"""Whole values of one parameter, whatever ZeRO did to it: DeepSpeed's ``safe_get_full_*`` functions.

A trained parameter's fp32 master value lives in its flat group's master buffer, split across ranks from
stage 1 on (and on the host under offload). These functions find the engine and group that own a
parameter, all-gather that group's master (a collective: every rank must call them, in the same
order), and cut the parameter out. Engines register themselves when they are built
(`runtime.engine.accessors.EngineAccessors`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runtime.deepspeed_api.unsupported import unsupported
from runtime.engine.accessors import live_engines
from runtime.zero.gather import gather_flat

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "set_z3_leaf_modules",
]


def _locate(param: nn.Parameter) -> tuple[Any, Any, int]:
    """(engine, flat group, index of the parameter in the group) of a parameter some engine trains."""
    for engine in live_engines():
        for group in getattr(engine, "groups", ()):
            for i, p in enumerate(group.params):
                if p is param:
                    return engine, group, i
    raise ValueError(
        "this parameter is not trained by any engine of this process (frozen, or the model was not "
        "passed to deepspeed.initialize / runtime.initialize)"
    )


def _full_master(engine: Any, group: Any) -> torch.Tensor:
    from runtime.zero.gather import gather_flat_master

    engine.masters.flush()  # an offloaded update still in flight lands first
    return gather_flat_master(group, engine.comm)


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor:
    """The parameter's full fp32 master value (a fresh tensor shaped like it). Collective."""
    engine, group, i = _locate(param)
    slot = group.layout.slots[i]
    return _full_master(engine, group).narrow(0, slot.offset, slot.numel).view(param.shape).clone()


def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite the parameter's fp32 master value (and its working copy) with `value`, which every
    rank passes whole. Collective only in the sense that every rank must pass the same value."""
    engine, group, i = _locate(param)
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(
            f"safe_set_full_fp32_param: value shape {tuple(value.shape)} != {tuple(param.shape)}"
        )
    engine.masters.flush()
    slot = group.layout.slots[i]
    flat_value = value.detach().reshape(-1).to(group.master.dtype)
    with torch.no_grad():
        for bucket in group.layout.buckets:
            start, end = bucket.piece(group.rank)  # this rank's piece, in flat-layout coordinates
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo >= hi:
                continue
            master_at = bucket.shard_offset + (lo - start)
            group.master.data[master_at : master_at + hi - lo].copy_(
                flat_value[lo - slot.offset : hi - slot.offset]
            )
        group.copy_master_to_working()
    if engine.zero_stage < 3:
        # stages 0-2 keep whole working weights on every rank; the master shard above was this rank's part
        with torch.no_grad():
            param.data.copy_(value.to(param.dtype))


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The parameter's full gradient, averaged over ranks, between backward and step. Available where
    the gradient is whole on each rank (ZeRO stages 0 and 1)."""
    engine, _group, _i = _locate(param)
    if engine.zero.grads_are_sharded:
        unsupported(
            f"safe_get_full_grad under ZeRO stage {engine.zero_stage} (sharded gradients)",
            "read it under stage 0 or 1, or use engine.get_global_grad_norm() for the norm",
        )
    if param.grad is None:
        return None
    return param.grad.detach().float().clone()


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor:
    """The parameter's full optimizer state `optim_state_key` ("exp_avg", "exp_avg_sq"). Collective."""
    engine, group, i = _locate(param)
    engine.masters.flush()
    state = engine.optimizer.state.get(group.master, {})
    if optim_state_key not in state:
        raise KeyError(f"optimizer state {optim_state_key!r} not found; keys: {sorted(state)}")
    flat = gather_flat(group, engine.comm, state[optim_state_key])
    slot = group.layout.slots[i]
    return flat.narrow(0, slot.offset, slot.numel).view(param.shape).clone()


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[Any]) -> list[nn.Module]:
    """DeepSpeed's ZeRO-3 "leaf" marking (gather a module's whole subtree at once, for MoE blocks whose
    experts run data-dependently)."""
    unsupported(
        "set_z3_leaf_modules (ZeRO-3 leaf modules)",
        "dslaunch gathers ZeRO-3 parameters per unit of the module tree; models with data-dependent "
        "experts (MoE) are not supported",
    )
