"""``deepspeed.ops.adagrad``: CPU Adagrad (runtime.ops.adagrad)."""

from runtime.ops.adagrad import CPUAdagrad as DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
