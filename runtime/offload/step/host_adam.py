"""The offloaded optimizer step for Adam and AdamW: one pass over host memory, straight from landed grads.

Works with the optimizer the engine built over the host master shards, whichever of these it is:
`runtime.ops.adam.CPUAdam` (DeepSpeedCPUAdam) or `torch.optim.Adam` / `AdamW` (what the config's
"Adam"/"AdamW" builds). Their state uses the same keys (`step` as a float32 tensor, `exp_avg`,
`exp_avg_sq`), so a state dict looks the same with and without offload, and checkpoints move between
the two. The update itself is `runtime.ops.adam_step.adam_step_` on slices of the flat master, gradient and
state tensors: fp32 master/m/v, the landed bf16/fp16 gradient converted in cache, the loss-scale and
clipping factor applied inside the kernel, and the low-precision copy of the updated weights written into
the landing buffer the gradient came from (the gradient chunk is already consumed by then), so the copy
back to the device reads what the kernel just wrote. 28 bytes of DRAM traffic a parameter; no
temporaries.

The engine drives the update chunk by chunk (`update`), so it can start copying chunk i back while the
host computes chunk i+1. Optimizer step hooks do not run on this path (LR schedulers work: the
hyperparameters are read from `param_groups` at every step).

Anything else (AMSGrad, maximize, SGD, Lamb, ...) takes the generic path in `host_step.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from runtime.offload.step.speculative import Shadow
from runtime.ops.adam import CPUAdam
from runtime.ops.adam_step import AdamHyperparams, adam_step_, default_chunk_elems, scratch_elems


def adam_hyperparams(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> AdamHyperparams | None:
    """The group's settings when `optimizer` is an Adam this path runs exactly; None otherwise."""
    if isinstance(optimizer, CPUAdam):
        return AdamHyperparams.from_group(group)
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW is a subclass in recent torch
        return None
    if any(group.get(key, False) for key in ("amsgrad", "maximize", "differentiable", "capturable")):
        return None
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
    beta1, beta2 = group["betas"]
    return AdamHyperparams(
        lr=float(group["lr"]),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        adamw_mode=decoupled,
        bias_correction=True,
    )


def supports(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether every param group of `optimizer` can take the one-pass path."""
    if optimizer is None or getattr(optimizer, "runs_own_update", False):
        return False  # runtime.precision.MasterAdam (bf16 masters): its own step() on the host masters
    groups = optimizer.param_groups
    return all(len(g["params"]) == 1 and adam_hyperparams(optimizer, g) is not None for g in groups)


class HostAdam:
    """Runs Adam/AdamW updates on slices of the flat host masters, with the optimizer's own state."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        masters: Sequence[torch.Tensor],
        *,
        zeros: Callable[[int, torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.masters = list(masters)
        # where the moments live: plain host memory, or pinned where a copy engine streams them
        self._zeros = zeros or (lambda numel, dtype: torch.zeros(numel, dtype=dtype))
        self._settings: list[tuple[int, AdamHyperparams]] = []
        self._scratch: torch.Tensor | None = None
        # set for a speculative step (speculative.py): its updates go there, the state stays as it was
        self.shadow: Shadow | None = None
        self.cache_chunk = default_chunk_elems()
        # each master's param group, found by identity: with partial offload (ratio < 1) the optimizer
        # also holds the device's masters, whose groups this path never touches
        by_master = {id(g["params"][0]): g for g in optimizer.param_groups if len(g["params"]) == 1}
        self.param_groups: list[dict[str, Any]] = []
        for master in self.masters:
            if id(master) not in by_master:
                raise ValueError("HostAdam: the optimizer's param groups must be the host master shards")
            self.param_groups.append(by_master[id(master)])
            # allocated now (and every page touched), so a host short of memory fails at setup
            self._state(master)

    def _state(self, master: torch.Tensor) -> dict[str, Any]:
        state = self.optimizer.state[master]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = self._zeros(master.numel(), master.dtype).view(master.shape)
            state["exp_avg_sq"] = self._zeros(master.numel(), master.dtype).view(master.shape)
        elif not isinstance(state["step"], torch.Tensor):  # an int step, as DeepSpeed stores it
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
        return state

    def begin_step(self) -> None:
        """Advance every group's step count and read its hyperparameters (the scheduler's current lr)."""
        self._settings = []
        for group, master in zip(self.param_groups, self.masters, strict=True):
            hp = adam_hyperparams(self.optimizer, group)
            if hp is None:
                raise ValueError("HostAdam: a param group changed to settings this path cannot run")
            state = self._state(master)
            state["step"] += 1
            self._settings.append((int(state["step"].item()), hp))

    @property
    def settings(self) -> Sequence[tuple[int, AdamHyperparams]]:
        """Per group, the step count and hyperparameters `begin_step` read (read-only)."""
        return self._settings

    def moments(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's exp_avg and exp_avg_sq (flat, like its master)."""
        state = self.optimizer.state[self.masters[group]]
        return state["exp_avg"], state["exp_avg_sq"]

    def replace_moments(self, group: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        state = self.optimizer.state[self.masters[group]]
        state["exp_avg"], state["exp_avg_sq"] = exp_avg, exp_avg_sq

    def cancel_step(self) -> None:
        """Take back `begin_step`: no update ran after it, or (speculative) it only wrote the shadow."""
        for master in self.masters:
            self.optimizer.state[master]["step"] -= 1
        self._settings = []
        self.shadow = None

    def written(self, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where this step's new master, exp_avg and exp_avg_sq of `group` go (flat): the shadow's during
        a speculative step, else the state itself."""
        if self.shadow is not None:
            return self.shadow.state(group)
        exp_avg, exp_avg_sq = self.moments(group)
        return self.masters[group].data, exp_avg.view(-1), exp_avg_sq.view(-1)

    def commit_shadow(self) -> None:
        """The speculative step's verdict was finite: its shadow becomes the state (a swap of storage, no
        copy; the master Parameter, which the optimizer and the checkpoints know by identity, stays) and
        the old state becomes the next speculative step's shadow."""
        shadow, self.shadow = self.shadow, None
        assert shadow is not None
        for group, master in enumerate(self.masters):
            exp_avg, exp_avg_sq = self.moments(group)
            new = shadow.swap(group, (master.data, exp_avg, exp_avg_sq))
            master.data = new[0].view(master.shape)
            self.replace_moments(group, new[1].view(exp_avg.shape), new[2].view(exp_avg_sq.shape))

    def update(
        self,
        group: int,
        offset: int,
        grad: torch.Tensor,
        out: torch.Tensor | None,
        grad_scale: torch.Tensor | None,
    ) -> None:
        """Update master[offset : offset + grad.numel()] of `group` with `grad` (divided by `grad_scale`
        inside the kernel); `out`, when given, receives the updated weights in its own dtype."""
        master = self.masters[group]
        state = self.optimizer.state[master]
        numel = grad.numel()
        step, hp = self._settings[group]
        now = (master.data, state["exp_avg"], state["exp_avg_sq"])
        param, exp_avg, exp_avg_sq = (t.view(-1).narrow(0, offset, numel) for t in now)
        staged_grad = grad.dtype != master.dtype
        need = scratch_elems(numel, min(self.cache_chunk, numel), False, staged_grad)
        scratch = self._scratch_for(need, master.dtype) if need else None
        if self.shadow is None:
            adam_step_(
                param, grad, exp_avg, exp_avg_sq, step, hp,
                out=out, grad_scale=grad_scale, chunk_elems=self.cache_chunk, scratch=scratch,
            )  # fmt: skip
            return
        # speculative: each cache-sized chunk of the state is copied into the shadow and updated there
        # while it is in cache, so the state is read once and the shadow written once, as in place
        into = [t.narrow(0, offset, numel) for t in self.shadow.state(group)]
        for start in range(0, numel, self.cache_chunk):
            k = min(self.cache_chunk, numel - start)
            p, m, v = (dst.narrow(0, start, k).copy_(src.narrow(0, start, k)) for dst, src in zip(
                into, (param, exp_avg, exp_avg_sq), strict=True))  # fmt: skip
            adam_step_(
                p, grad.narrow(0, start, k), m, v, step, hp,
                out=None if out is None else out.narrow(0, start, k),
                grad_scale=grad_scale, chunk_elems=self.cache_chunk, scratch=scratch,
            )  # fmt: skip

    def _scratch_for(self, need: int, dtype: torch.dtype) -> torch.Tensor:
        if self._scratch is None or self._scratch.numel() < need or self._scratch.dtype != dtype:
            self._scratch = torch.empty(need, dtype=dtype)
        return self._scratch

    def state_bytes(self) -> int:
        total = 0
        for master in self.masters:
            total += sum(t.numel() * t.element_size() for t in self.optimizer.state[master].values())
        return total


def grad_scale(factor: float) -> torch.Tensor | None:
    """What the Adam kernel divides the landed gradients by to multiply them by `factor` (None: 1)."""
    return None if factor == 1.0 else torch.tensor(1.0 / factor, dtype=torch.float32)
