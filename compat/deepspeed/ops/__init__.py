"""``deepspeed.ops``: optimizers (runtime.ops). dslaunch builds no C++/CUDA op extensions."""

from deepspeed.ops import adagrad, adam, lion
from runtime.deepspeed_api.unsupported import missing_names

__all__ = ["adagrad", "adam", "lion"]


__getattr__ = missing_names(
    "deepspeed.ops",
    "dslaunch's optimizers are deepspeed.ops.adam (DeepSpeedCPUAdam, FusedAdam) and deepspeed.ops.adagrad",
)
