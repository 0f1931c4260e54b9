"""DeepSpeed's lr schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle) as torch LRSchedulers.

Stepped once per optimizer step. DeepSpeed counts `last_batch_iteration` from -1 (the value at construction,
before any step); a torch LRScheduler counts `last_epoch` from 0 at construction. So the lr after k calls to
step() is DeepSpeed's formula at iteration k - 1, and `last_batch_iteration` is `last_epoch - 1`.
state_dict()/load_state_dict() are torch's (every attribute but the optimizer), so a restored scheduler
continues exactly where it stopped.

Where we differ from DeepSpeed on purpose: warmup_max_lr=None means each param group's own initial lr
(DeepSpeed takes the first group's); OneCycle starts momentum at the value its own formula gives
(cycle_max_mom; DeepSpeed sets cycle_min_mom at construction and jumps to ~cycle_max_mom at the first step),
keeps each group's beta2 (DeepSpeed overwrites it with 0.99), and also cycles SGD's `momentum`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.optim.lr_scheduler import LRScheduler

from runtime.config.optim import SchedulerConfig, resolve_scheduler_config


def _per_group(value: float | Sequence[float], groups: int, name: str) -> list[float]:
    if isinstance(value, Sequence):
        if len(value) != groups:
            raise ValueError(f"{name}: {len(value)} values given for {groups} optimizer param groups")
        return [float(v) for v in value]
    return [float(value)] * groups


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> None:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps < 1:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in ("log", "linear"):
        raise ValueError(f'warmup_type must be "log" or "linear", got {warmup_type!r}')


class _IterationScheduler(LRScheduler):
    """Base: subclasses give the lrs at DeepSpeed iteration `it` (-1 = before the first step)."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer)  # applies iteration -1
        if last_batch_iteration != -1:
            # Resume at a given iteration (DeepSpeed's argument); state_dict() is the better way.
            self.last_epoch = last_batch_iteration + 1
            for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
                group["lr"] = lr
            self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
            self.after_lr_update()

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        self.after_lr_update()

    def after_lr_update(self) -> None:
        """Hook for schedules that also set something besides the lr (OneCycle's momentum)."""

    @property
    def last_batch_iteration(self) -> int:
        return self.last_epoch - 1

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return self.lrs_at(self.last_epoch - 1)

    def lrs_at(self, it: int) -> list[float]:
        raise NotImplementedError


class WarmupLR(_IterationScheduler):
    """warmup_min_lr -> warmup_max_lr over warmup_num_steps, then flat.

    lr(it) = min + (max - min) * gamma(it); gamma = log(it + 1) / log(W) ("log") or it / W ("linear") for
    it < W, else 1, with W = max(2, warmup_num_steps). Before the first step (it = -1) lr = min.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        groups = optimizer.param_groups
        self.min_lrs = _per_group(warmup_min_lr, len(groups), "warmup_min_lr")
        if warmup_max_lr is None:
            self.max_lrs = [float(g.get("initial_lr", g["lr"])) for g in groups]
        else:
            self.max_lrs = _per_group(warmup_max_lr, len(groups), "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def warmup_gamma(self, it: int) -> float:
        if self.warmup_type == "log":
            return math.log(it + 1) / math.log(self.warmup_num_steps)
        return it / self.warmup_num_steps

    def gamma(self, it: int) -> float:
        return self.warmup_gamma(it) if it < self.warmup_num_steps else 1.0

    def lrs_at(self, it: int) -> list[float]:
        if it < 0:
            return list(self.min_lrs)
        g = self.gamma(it)
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps: gamma = max(0, (T - it) / max(1, T - W))."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps < 1:
            raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r}")
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )

    def gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return self.warmup_gamma(it)
        remaining = self.total_num_steps - it
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_IterationScheduler):
    """Ratios of each group's initial lr: warmup from warmup_min_ratio to 1 (log or linear, as WarmupLR),
    then cosine down to cos_min_ratio at total_num_steps and flat after it. 0 before the first step.

    After warmup: p = min(1, (it - W + 1) / max(1, T - W));
    ratio = cos_min + (1 - cos_min) * (1 + cos(pi * p)) / 2.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 1e-4,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps < 1:
            raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r}")
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def ratio(self, it: int) -> float:
        if it < 0:
            return 0.0
        w = self.warmup_num_steps
        if it < w:
            gamma = math.log(it + 1) / math.log(w) if self.warmup_type == "log" else it / w
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        progress = min(1.0, (it - w + 1) / max(1, self.total_num_steps - w))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs_at(self, it: int) -> list[float]:
        r = self.ratio(it)
        return [float(base) * r for base in self.base_lrs]


class OneCycle(_IterationScheduler):
    """One cycle of lr up (cycle_first_step_size steps) and down (cycle_second_step_size), then decay.

    In the cycle, with b = it + 1 and x = position in [0, 1) of b within the cycle, the scale s rises
    0 -> 1 over the first part and falls back to 0 over the second; lr = min + (max - min) s and momentum =
    max_mom - (max_mom - min_mom) s. A stair count > 0 holds s flat in that many stairs per half. After the
    cycle, d = it - cycle_length + 1: lr = min_lr / (1 + decay_lr_rate d / decay_step_size) and momentum =
    max_mom (1 + decay_mom_rate d / decay_step_size); a zero rate or step size means no decay.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        if cycle_first_step_size < 1 or (cycle_second_step_size is not None and cycle_second_step_size < 1):
            raise ValueError("cycle step sizes must be positive integers")
        self.min_lr, self.max_lr = float(cycle_min_lr), float(cycle_max_lr)
        self.decay_lr_rate = float(decay_lr_rate)
        self.first_size = int(cycle_first_step_size)
        self.second_size = int(cycle_second_step_size or cycle_first_step_size)
        self.first_stairs = int(cycle_first_stair_count)
        second = cycle_second_stair_count
        self.second_stairs = int(cycle_first_stair_count if second is None else second)
        self.decay_step_size = int(decay_step_size)
        self.min_mom, self.max_mom = float(cycle_min_mom), float(cycle_max_mom)
        self.decay_mom_rate = float(decay_mom_rate)
        defaults = optimizer.defaults
        self.momentum_key = (
            "betas" if "betas" in defaults else ("momentum" if "momentum" in defaults else None)
        )
        self.cycle_momentum = bool(cycle_momentum) and self.momentum_key is not None
        super().__init__(optimizer, last_batch_iteration)

    @property
    def cycle_length(self) -> int:
        return self.first_size + self.second_size

    def scale(self, it: int) -> float:
        """Position on the cycle's triangle, 0 at the ends and 1 at the peak."""
        b = (it + 1) % self.cycle_length
        if b <= self.first_size:
            stairs, s = self.first_stairs, b / self.first_size
            position = b
            size = self.first_size
        else:
            stairs, s = self.second_stairs, (self.cycle_length - b) / self.second_size
            position = self.cycle_length - b
            size = self.second_size
        if stairs > 0:  # quantise from the integer position so the peak is exactly 1
            s = math.floor(position * stairs / size) / stairs
        return s

    def lrs_at(self, it: int) -> list[float]:
        if it < self.cycle_length:
            lr = self.min_lr + (self.max_lr - self.min_lr) * self.scale(it)
        elif self.decay_step_size == 0 or self.decay_lr_rate == 0:
            lr = self.min_lr
        else:
            d = it - self.cycle_length + 1
            lr = self.min_lr / (1.0 + self.decay_lr_rate * d / self.decay_step_size)
        return [lr] * len(self.optimizer.param_groups)

    def momentum_at(self, it: int) -> float:
        if it < self.cycle_length:
            return self.max_mom - (self.max_mom - self.min_mom) * self.scale(it)
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return self.max_mom
        d = it - self.cycle_length + 1
        return self.max_mom * (1.0 + self.decay_mom_rate * d / self.decay_step_size)

    def after_lr_update(self) -> None:
        if not self.cycle_momentum:
            return
        momentum = self.momentum_at(self.last_epoch - 1)
        for group in self.optimizer.param_groups:
            if self.momentum_key == "betas":
                group["betas"] = (momentum, group["betas"][1])
            else:
                group["momentum"] = momentum


_SCHEDULERS: dict[str, type[LRScheduler]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
}


def build_scheduler(config: SchedulerConfig, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """The schedule the config names, attached to `optimizer`; step it once per optimizer step."""
    config = resolve_scheduler_config(config)
    return _SCHEDULERS[config.type](optimizer, **config.params)
