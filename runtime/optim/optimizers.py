"""Optimizers for the config's `optimizer` section: torch Adam/AdamW/SGD, our own Lamb, Muon (muon.py).

`build_optimizer` is what the engine calls, on model parameters (stage 0) or on the fp32 master shards
of ZeRO (plain leaf tensors, possibly on CPU under offload). Adam/AdamW use torch's fused kernels when every
tensor sits on one device type that has them: on CPU, fused AdamW runs at memory bandwidth, about 4x faster
than foreach and as fast as DeepSpeed's C++ CPUAdam (research/cpu_adam_bench.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from runtime.config.optim import OptimizerConfig, resolve_optimizer_config
from runtime.optim.muon import MuonWithAuxAdam


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019) with DeepSpeed's FusedLamb semantics, per parameter tensor.

    m, v are Adam's moments (not bias-corrected in place). update = m / (sqrt(v) + eps) + weight_decay * p
    (or m / sqrt(v + eps) with eps_inside_sqrt). trust = ||p|| / ||update|| clamped to [min_coeff, max_coeff],
    or 1 when either norm is zero. p -= step_size * trust * update, where step_size carries the bias
    correction: lr * sqrt(1 - beta2^t) / (1 - beta1^t). The last trust ratio is kept in state["trust_ratio"].
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        eps_inside_sqrt: bool = False,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"Lamb: lr, eps and weight_decay must be >= 0 (got {lr}, {eps}, {weight_decay})")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lamb: betas must be in [0, 1), got {betas}")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb: need 0 <= min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            eps_inside_sqrt=eps_inside_sqrt,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                self._step_one(param, group, beta1, beta2)
        return loss

    def _step_one(self, param: torch.Tensor, group: dict[str, Any], beta1: float, beta2: float) -> None:
        grad = param.grad
        state = self.state[param]
        if not state:
            # The step count lives on the CPU so that reading it for the bias correction never syncs a GPU.
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        step = int(state["step"].item())
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)

        if group["eps_inside_sqrt"]:
            denom = exp_avg_sq.add(group["eps"]).sqrt_()
        else:
            denom = exp_avg_sq.sqrt().add_(group["eps"])
        update = exp_avg / denom
        if group["weight_decay"] != 0:
            update.add_(param, alpha=group["weight_decay"])

        # Norms in at least fp32 (bf16 sums lose digits); torch.where keeps the ratio on device (no sync).
        norm_dtype = torch.promote_types(param.dtype, torch.float32)
        w_norm = torch.linalg.vector_norm(param, dtype=norm_dtype)
        u_norm = torch.linalg.vector_norm(update, dtype=norm_dtype)
        ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
        trust = torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
        state["trust_ratio"] = trust

        step_size = group["lr"]
        if group["bias_correction"]:
            step_size *= math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
        param.add_(update.mul_(trust.to(update.dtype)), alpha=-step_size)


def _tensors(params: list[torch.nn.Parameter] | list[dict[str, Any]]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            group = item.get("params", [])
            out.extend([group] if isinstance(group, torch.Tensor) else list(group))
        else:
            out.append(item)
    return out


def _fused_devices() -> set[str]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return set(_get_fused_kernels_supported_devices())
    except ImportError:  # older torch: CPU fused Adam exists since 2.4, CUDA since 2.0
        return {"cpu", "cuda"}


def adam_implementation(tensors: list[torch.Tensor]) -> dict[str, bool]:
    """{"fused": True} when torch's fused Adam kernel takes every tensor, else {} (torch then picks foreach
    on GPUs and the for-loop on CPU). Tensors on several device types are fine (partial optimizer offload
    keeps some masters on the GPU and the rest on the host): torch groups them by device and runs each
    group's fused kernel. Besides speed, fused matters for memory: foreach Adam allocates a full fp32
    temporary of every tensor it steps (the denominator), 16 GiB for the GPU's share of a 13B model."""
    device_types = {t.device.type for t in tensors}
    dtypes_ok = all(t.is_floating_point() for t in tensors)
    if dtypes_ok and device_types <= _fused_devices():
        return {"fused": True}
    return {}


def build_optimizer(
    config: OptimizerConfig, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]
) -> torch.optim.Optimizer:
    """The optimizer the config names, over `params` (tensors or torch param-group dicts).

    "Adam" with DeepSpeed's default adam_w_mode=true is AdamW (decoupled weight decay); "torch_adam" is
    accepted and changes nothing, since these are always torch's implementations.
    """
    config = resolve_optimizer_config(config)
    # one of the two kinds of list, whichever `params` held (mypy joins the two to list[object])
    param_list = cast("list[torch.nn.Parameter] | list[dict[str, Any]]", list(params))
    tensors = _tensors(param_list)
    if not tensors:
        raise ValueError(f"build_optimizer: {config.type} got no parameters to optimize")
    p = config.params
    if config.type in ("Adam", "AdamW"):
        decoupled = config.type == "AdamW" or p["adam_w_mode"]
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        return cls(
            param_list,
            lr=p["lr"],
            betas=tuple(p["betas"]),
            eps=p["eps"],
            weight_decay=p["weight_decay"],
            amsgrad=p["amsgrad"],
            **adam_implementation(tensors),
        )
    if config.type == "Muon":
        return MuonWithAuxAdam(
            cast("list[dict[str, Any]]", param_list),
            lr=p["lr"],
            momentum=p["momentum"],
            weight_decay=p["weight_decay"],
            nesterov=p["nesterov"],
            ns_steps=p["ns_steps"],
            adjust_lr_fn=p["adjust_lr_fn"],
            adam_lr=p["adam_lr"],
            betas=tuple(p["betas"]),
            eps=p["eps"],
            fused=adam_implementation(tensors).get("fused"),
        )
    if config.type == "Lamb":
        return Lamb(
            param_list,
            lr=p["lr"],
            betas=tuple(p["betas"]),
            eps=p["eps"],
            weight_decay=p["weight_decay"],
            bias_correction=p["bias_correction"],
            max_coeff=p["max_coeff"],
            min_coeff=p["min_coeff"],
            eps_inside_sqrt=p["eps_inside_sqrt"],
        )
    return torch.optim.SGD(
        param_list,
        lr=p["lr"],
        momentum=p["momentum"],
        dampening=p["dampening"],
        weight_decay=p["weight_decay"],
        nesterov=p["nesterov"],
    )
