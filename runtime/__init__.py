"""dslaunch's training runtime: ZeRO partitioning, CPU offload and mixed precision on torch.distributed.

User scripts ``import runtime`` where they would ``import deepspeed``.
"""

__version__ = "0.1.0"
