"""fp16 loss scaling as a small state machine on Python numbers: no tensors, no collectives.

The engine multiplies the loss by `scale` before backward, detects non-finite gradients on every rank
(one all-reduce, fused with the gradient norm), and then calls `update(overflow)` with the same answer on
every rank, so every rank keeps the same scale and skips the same steps.

`DynamicLossScaler` follows DeepSpeed's documented semantics:
- start at 2**initial_scale_power;
- an overflow skips the step; the scale halves once `hysteresis` overflows have been absorbed (each
  overflow before that only uses up one unit of hysteresis);
- with consecutive_hysteresis the hysteresis refills after every clean step (so only `hysteresis`
  *consecutive* overflows halve the scale), otherwise only when the scale grows;
- after `window` clean steps since the last overflow the scale doubles;
- an overflow that would take the scale below `min_scale` raises `LossScaleError` instead of skipping
  forever (DeepSpeed users hit "Current loss scale already at minimum" after hours of skipped steps).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.precision.errors import LossScaleError


@dataclass(frozen=True)
class ScaleUpdate:
    """What one `update` did, for logging."""

    overflow: bool
    old_scale: float
    new_scale: float
    hysteresis_left: int


class StaticLossScaler:
    """A fixed scale (fp16 "loss_scale" > 0). Overflowing steps are still skipped; the scale never moves."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError(f"static loss scale must be > 0, got {scale}")
        self.scale = float(scale)

    def update(self, overflow: bool, step: int = -1) -> ScaleUpdate:
        return ScaleUpdate(overflow, self.scale, self.scale, 0)

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler:
    """Dynamic loss scale with hysteresis, a growth window and a floor (DeepSpeed semantics, factor 2)."""

    dynamic = True

    def __init__(
        self,
        *,
        initial_scale_power: int = 16,
        window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
        factor: float = 2.0,
    ) -> None:
        if window < 1:
            raise ValueError(f"loss_scale_window must be >= 1, got {window}")
        if hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1, got {hysteresis}")
        if not min_scale > 0:
            raise ValueError(f"min_loss_scale must be > 0, got {min_scale}")
        if not factor > 1:
            raise ValueError(f"scale factor must be > 1, got {factor}")
        self.scale = float(2.0**initial_scale_power)
        self.window = window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self.factor = float(factor)
        self.hysteresis_left = hysteresis
        self.iteration = 0  # updates seen so far
        self.last_overflow_iteration = -1
        self.consecutive_overflows = 0

    def update(self, overflow: bool, step: int = -1) -> ScaleUpdate:
        """Advance the state machine by one optimizer step; `step` only appears in error messages."""
        old = self.scale
        if overflow:
            self.consecutive_overflows += 1
            if self.hysteresis_left <= 1:
                if self.scale <= self.min_scale:
                    where = f"at step {step}" if step >= 0 else "again"
                    raise LossScaleError(
                        f"fp16 gradients overflowed {where} with the loss scale already at min_loss_scale "
                        f"({self.min_scale:g}) after {self.consecutive_overflows} consecutive overflowing "
                        "steps, each skipped; training cannot make progress",
                        hint='use bf16 ("bf16": {"enabled": true}), set gradient_clipping or lower the '
                        "learning rate, or check the data and the model for inf/nan",
                    )
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            self.consecutive_overflows = 0
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if (self.iteration - self.last_overflow_iteration) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= self.factor
        self.iteration += 1
        return ScaleUpdate(overflow, old, self.scale, self.hysteresis_left)

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self.scale,
            "hysteresis_left": self.hysteresis_left,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
            "consecutive_overflows": self.consecutive_overflows,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
        self.consecutive_overflows = int(state.get("consecutive_overflows", 0))


LossScaler = StaticLossScaler | DynamicLossScaler

__all__ = ["DynamicLossScaler", "LossScaleError", "LossScaler", "ScaleUpdate", "StaticLossScaler"]
