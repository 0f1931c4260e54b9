"""The mixed-precision errors a user causes and can fix: a one-line message and a `hint` (what to change).

- `NonfiniteGradientsError`: bf16/fp32 steps kept producing non-finite gradients (nonfinite.py);
- `LossScaleError`, one of those: fp16 gradients overflow at the minimum loss scale (loss_scaler.py);
- `InputDtypeError`: the model failed on forward inputs of another dtype than its weights (mixed.py).

They are `runtime.errors.UserError`s (one line and the hint, no traceback, exit code 2) and keep
RuntimeError as a base (what torch raised before, so `except RuntimeError` keeps working).
"""

from __future__ import annotations

from runtime.errors import UserError


class PrecisionError(UserError, RuntimeError):
    """A training failure the user fixes in the config or the data; `hint` says how ("" if nothing to add)."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message, hint=hint)


class NonfiniteGradientsError(PrecisionError):
    """Too many consecutive steps had non-finite gradients (each was skipped): training stops."""


class LossScaleError(NonfiniteGradientsError):
    """fp16 gradients keep overflowing at the minimum loss scale: training cannot make progress."""


class InputDtypeError(PrecisionError):
    """The model's forward failed because floating-point inputs are not in the working dtype."""


__all__ = ["InputDtypeError", "LossScaleError", "NonfiniteGradientsError", "PrecisionError"]
