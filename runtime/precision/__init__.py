"""Mixed precision: dtype policy, fp16 loss scaling, bf16 master weights (master_adam.py), the gradient
math of the optimizer step (grad_math.py), and what a step with non-finite gradients does (nonfinite.py)."""

from runtime.precision.errors import InputDtypeError, LossScaleError, NonfiniteGradientsError
from runtime.precision.grad_math import GradMath, GradResult, finish_grads
from runtime.precision.loss_scaler import DynamicLossScaler, ScaleUpdate, StaticLossScaler
from runtime.precision.master_adam import MasterAdam, for_masters, stochastic_round_
from runtime.precision.mixed import PrecisionPolicy, policy_from_config, scaler_from_config
from runtime.precision.nonfinite import StepGuard, guard_from_config

__all__ = [
    "DynamicLossScaler",
    "GradMath",
    "GradResult",
    "InputDtypeError",
    "LossScaleError",
    "MasterAdam",
    "NonfiniteGradientsError",
    "PrecisionPolicy",
    "ScaleUpdate",
    "StaticLossScaler",
    "StepGuard",
    "finish_grads",
    "for_masters",
    "guard_from_config",
    "policy_from_config",
    "scaler_from_config",
    "stochastic_round_",
]
