"""Torch's Adam/AdamW state laid out for the fused master step: the moments of each param group as one flat
fp32 buffer beside its master, with every parameter's `exp_avg` / `exp_avg_sq` a view into it.

Owns `unsupported_reason` (which optimizers the fused step can stand in for), `make_adam_state` (the
state torch's first step would make, made while the engine is built, in that layout), and the two
questions the step asks of a state it finds (`offset_in`: where a parameter sits in its master;
`flat_moment`: whether a group's moments are already views of one buffer). The values and places are
torch's own, so `state_dict`, checkpoints and torch's unfused step read them unchanged
(runtime/precision/fused_master.py takes the step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def unsupported_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why `FusedMasterAdam` cannot take `optimizer`'s step, or None when it can (torch's own Adam or
    AdamW, none of the options its kernel leaves out)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"the optimizer is {type(optimizer).__name__}, not torch's Adam or AdamW"
    for group in optimizer.param_groups:
        for key in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(key):
                return f"{key}=True"
    return None


def offset_in(master: torch.Tensor, param: torch.Tensor) -> int | None:
    """Where `param` starts in `master`, in elements, or None when it is not a view inside it."""
    offset = int(param.storage_offset() - master.storage_offset())
    inside = 0 <= offset <= master.numel() - param.numel()
    same = param.untyped_storage().data_ptr() == master.untyped_storage().data_ptr()
    return offset if same and inside else None


def flat_moment(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], master: torch.Tensor, key: str
) -> torch.Tensor | None:
    """The one fp32 buffer, shaped like `master`, of which every param's `key` state is the view at that
    param's place (as `make_adam_state` lays them out), or None."""
    flat = None
    for param in params:
        moment = optimizer.state.get(param, {}).get(key)
        base = moment._base if isinstance(moment, torch.Tensor) else None
        offset = offset_in(master, param)
        if base is None or offset is None or (flat is not None and base is not flat):
            return None
        if base.dtype != torch.float32 or base.device != master.device or base.shape != master.shape:
            return None
        if moment.data_ptr() != base.data_ptr() + offset * base.element_size():
            return None
        flat = base
    return flat


def make_adam_state(
    optimizer: torch.optim.Optimizer, masters: Sequence[torch.Tensor], indices: Sequence[int]
) -> None:
    """Make now, while the engine is built, the state torch's Adam/AdamW makes in its first step (nothing
    for an optimizer this does not cover, or for a group whose state is there already).

    Made in the first step, after its backward, the moments let a first step fit where no later one does
    (bf16 masters' `MasterAdam.prepare` says what that cost on an H200); made here, a configuration that
    cannot hold them fails at setup, as DeepSpeed's ZeRO optimizers make their state at initialization.
    The values are torch's first ones (zero moments, step 0) in torch's places (a `step` on the device for
    a fused or capturable group, on the CPU otherwise), so torch's own step reads them as its own. Each
    group's moments are one flat fp32 buffer beside its master (`masters[i]`, the optimizer's param group
    `indices[i]`), the layout `FusedMasterAdam` keeps, so its first step takes them without a copy."""
    if unsupported_reason(optimizer) is not None:
        return
    for master, index in zip(masters, indices, strict=True):
        if index >= len(optimizer.param_groups):
            continue
        group = optimizer.param_groups[index]
        params = list(group["params"])
        if any(optimizer.state.get(param) for param in params):
            continue  # made already (a resume, or the host side of a partial offload)
        on_device = bool(group.get("fused") or group.get("capturable"))
        scalar = torch.float32 if on_device or torch.get_default_dtype() != torch.float64 else torch.float64
        flat = None
        if params and all(offset_in(master, p) is not None and p.dtype == torch.float32 for p in params):
            flat = {key: torch.zeros_like(master, dtype=torch.float32) for key in MOMENTS}
        for param in params:
            entry = optimizer.state[param]
            for key in MOMENTS:
                if flat is None:
                    entry[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
                else:
                    offset = offset_in(master, param)
                    assert offset is not None
                    entry[key] = flat[key].narrow(0, offset, param.numel()).view(param.shape)
            step_device = param.device if on_device else torch.device("cpu")
            entry["step"] = torch.zeros((), dtype=scalar, device=step_device)
