"""``deepspeed.ops``: optimizers (runtime.ops). dslaunch builds no C++/CUDA op extensions."""

from deepspeed.ops import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
