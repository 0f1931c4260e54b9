"""Adagrad for parameters in CPU memory, under DeepSpeed's ``DeepSpeedCPUAdagrad`` signature.

torch's Adagrad (foreach on CPU) is the implementation: the same update DeepSpeed's C++ op computes,
without a compiled extension. Accelerate swaps a torch Adagrad for this class when the optimizer state is
offloaded to the CPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["CPUAdagrad"]


class CPUAdagrad(torch.optim.Adagrad):
    """``DeepSpeedCPUAdagrad(model_params, lr, eps, weight_decay, amsgrad, fp32_optimizer_states)``;
    ``amsgrad`` has no meaning for Adagrad and must stay False."""

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if amsgrad:
            raise ValueError("CPUAdagrad: amsgrad=True has no meaning for Adagrad (DeepSpeed refuses it too)")
        self.fp32_optimizer_states = fp32_optimizer_states
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
