"""Mixed precision: dtype policy, fp16 loss scaling and the gradient math of the optimizer step."""

from runtime.precision.loss_scaler import DynamicLossScaler, LossScaleError, ScaleUpdate, StaticLossScaler
from runtime.precision.mixed import PrecisionPolicy, finish_grads, policy_from_config, scaler_from_config

__all__ = [
    "DynamicLossScaler",
    "LossScaleError",
    "PrecisionPolicy",
    "ScaleUpdate",
    "StaticLossScaler",
    "finish_grads",
    "policy_from_config",
    "scaler_from_config",
]
