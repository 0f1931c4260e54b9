"""Optimizer kernels that users may import directly, under DeepSpeed's names.

``runtime.ops.adam`` holds ``CPUAdam`` (alias ``DeepSpeedCPUAdam``) and ``FusedAdam``, so a script that did
``from deepspeed.ops.adam import DeepSpeedCPUAdam`` does ``from runtime.ops.adam import DeepSpeedCPUAdam``.
``runtime.ops.adam_step`` is the functional step underneath, which the CPU-offload engine calls on its flat
buffers.
"""
