"""What an engine's memory holds: `MemoryBreakdown`, the bytes of model state one rank keeps (the ZeRO
paper's "model states": working weights, gradients, masters, optimizer state) and its staging buffers, on
the device and on the host; `memory_breakdown` reads them off a built engine without synchronizing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runtime.engine.engine import Engine


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes of model state this rank holds (the ZeRO paper's "model states"), plus staging buffers."""

    param_bytes: int  # working weights (flat buffers and parameters the engine does not manage)
    grad_bytes: int  # gradient buffers (full for stages 0/1, this rank's shard for stage 2)
    master_bytes: int  # master weights (fp32, or bf16_master_weights_and_grads) not the working weights
    optimizer_bytes: int  # optimizer state tensors (Adam: exp_avg, exp_avg_sq, step)
    buffer_bytes: int = 0  # device staging buffers alive right now (communication, the offload's device step)
    host_bytes: int = 0  # of the model states above, the bytes in host memory (CPU offload)
    host_buffer_bytes: int = 0  # host staging buffers of the offload (gradient landing, copy-back)

    @property
    def model_state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.optimizer_bytes

    @property
    def device_model_state_bytes(self) -> int:
        """Model-state bytes on the training device (all of them without offload)."""
        return self.model_state_bytes - self.host_bytes

    @property
    def total_bytes(self) -> int:
        return self.model_state_bytes + self.buffer_bytes


def memory_breakdown(engine: Engine) -> MemoryBreakdown:
    """The bytes `engine` holds on this rank: its ZeRO stage's buffers, the masters' placement, the
    optimizer's state tensors, and the parameters the engine does not manage."""
    managed = {p for g in engine.groups for p in g.params}
    unmanaged = {
        p.data_ptr(): p.numel() * p.element_size() for p in engine.module.parameters() if p not in managed
    }
    optimizer_bytes = 0
    if engine.optimizer is not None:
        for state in engine.optimizer.state.values():
            optimizer_bytes += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    host_bytes, host_buffer_bytes = engine.masters.host_bytes(engine.optimizer)
    return MemoryBreakdown(
        param_bytes=engine.zero.param_bytes() + sum(unmanaged.values()),
        grad_bytes=engine.zero.grad_bytes(),
        master_bytes=sum(
            g.master.numel() * g.master.element_size() for g in engine.groups if not g.master_is_alias
        ),
        optimizer_bytes=optimizer_bytes,
        buffer_bytes=engine.zero.buffer_bytes() + engine.masters.device_buffer_bytes(),
        host_bytes=host_bytes,
        host_buffer_bytes=host_buffer_bytes,
    )
