"""What the engine does with a step whose gradients are not finite, per precision: the `StepGuard`.

The verdict comes from `finish_grads` (grad_math.py; `scale_from_device_grads` there does the same
arithmetic): the global gradient norm, reduced over ranks with the one all-reduce the norm already needs
when gradients are sharded, so every rank reaches the same verdict; reading it is the step's one host sync.
A norm of inf or nan also catches gradients that are finite but so large that their squares overflow
(a loss of 1e30 in fp32), which would make Adam's second moment inf for good.

When the verdict is "not finite", the placement (`runtime.offload.MasterPlacement.step`) has updated
nothing, the engine does not step the LR scheduler (DeepSpeed's rule for skipped fp16 steps) and counts
the step in `skipped_steps`, and the guard decides what else happens:

- fp16, `LossScaling`: the loss scaler's semantics, unchanged (lower the scale after `hysteresis`
  overflows; `LossScaleError` at `min_loss_scale`). Each skipped step is a warning on rank 0 naming the
  step and the scale (DeepSpeed prints "OVERFLOW! ... Skipping step"), the first `WARN_FIRST` of a run
  and then one in `WARN_EVERY` (a run at a too-high scale would otherwise skip in silence with
  steps_per_print 0); overflows are also summarized in the periodic report.
- bf16 and fp32, `SkipNonfinite`: a warning on rank 0 naming the step, every time; after
  `bf16.max_consecutive_nonfinite_steps` consecutive skips (0: never) `NonfiniteGradientsError` on every
  rank at the same step. There is no fp32 section: the bf16 section's key governs fp32 runs too, and an
  fp32 run's messages say so (`limit_key`).
- bf16 and fp32 with `bf16.check_grad_overflow: false`, `ApplyAlways`: no verdict, every step applied
  (DeepSpeed's default for bf16). The offloaded update starts during backward with every guard (one
  rank, no clipping); under a checking one it goes to a second copy of the state that a non-finite
  verdict drops (runtime/offload/step/speculative.py), so the skip above stays exact.

The guard also owns the loss scaling of backward (`scale`), so the engine never asks which precision runs.
"""

from __future__ import annotations

import logging
import math
from typing import Protocol

import torch
import torch.distributed as dist

from runtime.config import Config
from runtime.precision.errors import NonfiniteGradientsError
from runtime.precision.loss_scaler import LossScaler, ScaleUpdate
from runtime.precision.mixed import scaler_from_config

LIMIT_KEY = "bf16.max_consecutive_nonfinite_steps"
WARN_FIRST = 20  # fp16: skipped steps warned one by one at the start of a run (a high initial scale)...
WARN_EVERY = 100  # ...then one warning per this many

_log = logging.getLogger("runtime.precision")


def limit_key(precision: str) -> str:
    """The key that limits consecutive skipped steps, as messages of a `precision` ("bf16", "fp32") run
    name it."""
    return LIMIT_KEY if precision == "bf16" else f"{LIMIT_KEY}, which governs {precision} runs too"


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class SkipLog(Protocol):
    """Where skipped steps are reported (runtime.engine.log.StepLog; rank 0 prints)."""

    def overflow(self, update: ScaleUpdate, step: int) -> None: ...

    def nonfinite(
        self, step: int, norm: float, consecutive: int, limit: int, key: str = LIMIT_KEY
    ) -> None: ...


class StepGuard(Protocol):
    checks: bool  # steps are decided on the gradients' finiteness (costs the norm and one host sync)

    @property
    def loss_scaler(self) -> LossScaler | None:
        """The fp16 scaler (checkpointed), None otherwise."""
        ...

    @property
    def loss_scale(self) -> float: ...

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward runs on."""
        ...

    def skipped(self, *, step: int, norm: torch.Tensor | None, log: SkipLog) -> None:
        """Step `step` (1-based) had non-finite gradients and was skipped; may raise to stop training."""
        ...

    def applied(self, *, step: int) -> None:
        """Step `step` was applied."""
        ...


class LossScaling:
    """fp16: the loss scaler scales the loss and decides what an overflow does."""

    checks = True

    def __init__(self, scaler: LossScaler) -> None:
        self.loss_scaler: LossScaler = scaler
        self.overflows = 0  # skipped steps of this run, for the rate of the warnings

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scaler.scale

    def skipped(self, *, step: int, norm: torch.Tensor | None, log: SkipLog) -> None:
        update = self.loss_scaler.update(True, step=step)  # raises LossScaleError at min_loss_scale
        self.overflows += 1
        if _is_rank0() and (self.overflows <= WARN_FIRST or self.overflows % WARN_EVERY == 0):
            _log.warning("%s", overflow_message(step, update, self.overflows))
        log.overflow(update, step)

    def applied(self, *, step: int) -> None:
        self.loss_scaler.update(False, step=step)


class SkipNonfinite:
    """bf16/fp32: skip non-finite steps, say so, and stop after `limit` in a row (0: never)."""

    loss_scaler = None
    checks = True
    loss_scale = 1.0

    def __init__(self, limit: int, precision: str = "bf16") -> None:
        if limit < 0:
            raise ValueError(f"{LIMIT_KEY} must be >= 0, got {limit}")
        self.limit = limit
        self.key = limit_key(precision)
        self.consecutive = 0
        self.first_skipped = 0  # the first step of the current run of skipped steps

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def skipped(self, *, step: int, norm: torch.Tensor | None, log: SkipLog) -> None:
        if self.consecutive == 0:
            self.first_skipped = step
        self.consecutive += 1
        value = math.nan if norm is None else float(norm)  # the verdict already waited for it
        log.nonfinite(step, value, self.consecutive, self.limit, key=self.key)
        if self.limit and self.consecutive >= self.limit:
            raise NonfiniteGradientsError(
                f"step {step}: {self.consecutive} consecutive steps (from step {self.first_skipped}) had a "
                f"non-finite gradient norm (last: {value}) and were skipped; training stopped "
                f"({self.key.replace(LIMIT_KEY, f'{LIMIT_KEY}={self.limit}', 1)})",
                hint="set gradient_clipping (e.g. 1.0) or lower the learning rate, and check the data and "
                f"the loss for inf/nan; the weights are still those from before step {self.first_skipped}",
            )

    def applied(self, *, step: int) -> None:
        self.consecutive = 0


class ApplyAlways:
    """bf16/fp32 with `bf16.check_grad_overflow: false`: no verdict; every step is applied."""

    loss_scaler = None
    checks = False
    loss_scale = 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def skipped(self, *, step: int, norm: torch.Tensor | None, log: SkipLog) -> None:
        raise AssertionError("a step was skipped although no step is checked")

    def applied(self, *, step: int) -> None:
        pass


def guard_from_config(config: Config) -> StepGuard:
    """The guard a runtime `Config` asks for."""
    scaler = scaler_from_config(config)
    if scaler is not None:
        return LossScaling(scaler)
    if not config.bf16.check_grad_overflow:
        return ApplyAlways()
    precision = "bf16" if config.bf16.enabled else "fp32"
    return SkipNonfinite(config.bf16.max_consecutive_nonfinite_steps, precision)


def overflow_message(step: int, update: ScaleUpdate, overflows: int) -> str:
    """The warning for an fp16 step skipped for overflowing gradients."""
    if update.new_scale != update.old_scale:
        scale = f"loss scale {update.old_scale:g} -> {update.new_scale:g}"
    elif update.hysteresis_left:
        scale = (
            f"loss scale stays {update.old_scale:g}: {update.hysteresis_left} overflow(s) of hysteresis left"
        )
    else:
        scale = f"loss scale stays {update.old_scale:g}"
    text = f"step {step}: fp16 gradients overflowed; the step was skipped on every rank ({scale})"
    if overflows == WARN_FIRST:
        text += f"; further skipped steps are reported once every {WARN_EVERY}"
    elif overflows > WARN_FIRST:
        text += f" ({overflows} skipped steps so far)"
    return text


__all__ = [
    "ApplyAlways",
    "LossScaling",
    "NonfiniteGradientsError",
    "SkipLog",
    "SkipNonfinite",
    "StepGuard",
    "guard_from_config",
    "limit_key",
    "overflow_message",
]
