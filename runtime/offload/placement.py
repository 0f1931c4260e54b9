"""Where the optimizer's master weights live, as one part the engine composes: on the device or on the host.

The engine's step talks to a `MasterPlacement` and never asks where the state is:

    prepare_step(optimizer, math)                       # before the boundary backward
    begin_backward(boundary) / end_backward(boundary)   # around autograd (gradients may start moving)
    run_backward(backward)                              # autograd itself
    step(optimizer, math, per_tensor) -> GradResult     # norm, overflow, clip, optimizer update
    write_back()                                        # updated weights into the working buffers
    flush()                                             # nothing in flight (before reading the masters)

`DeviceMasters` is the plain case (the masters sit next to the gradients: fp32 master gradients, then
`finish_grads`, then `optimizer.step()`, then the ZeRO stage writes back and all-gathers).
`HostMasters` (host_masters.py) is `offload_optimizer: {device: cpu}`, and `PartialMasters` (partial.py)
that with a `ratio` below 1 (some groups on each side); the package's front door
(`runtime.offload.build_master_placement`) picks one. This module imports nothing from runtime/offload,
so every other part of it may import this one.

Each `step` gets the engine's `GradMath` (runtime/precision/grad_math.py: how many ranks and micro-steps
the sums span, the loss scale, the clipping norm, whether a norm is needed at all) and applies it
wherever its gradients are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from runtime.precision.grad_math import GradMath, GradResult, finish_grads, master_grads_from
from runtime.zero import StageGroups
from runtime.zero.flat import FlatGroup


class MasterPlacement(Protocol):
    def bind(self, optimizer: torch.optim.Optimizer | None) -> None:
        """The engine built `optimizer` over the masters (it decides, for instance, whether an offloaded
        step can run on the device)."""
        ...

    def prepare_step(self, optimizer: torch.optim.Optimizer, math: GradMath, *, per_tensor: bool) -> None:
        """Before the boundary backward, with the arithmetic `step` will get: a placement that can update
        while gradients arrive starts here."""
        ...

    def begin_backward(self, *, boundary: bool) -> None: ...

    def run_backward(self, backward: Callable[[], None]) -> None:
        """Run `backward` (autograd) between begin_backward and end_backward."""
        ...

    def end_backward(self, *, boundary: bool) -> None: ...

    def step(self, optimizer: torch.optim.Optimizer, math: GradMath, *, per_tensor: bool) -> GradResult:
        """Average, unscale and clip this rank's gradients and update its master shard; on overflow
        nothing is updated."""
        ...

    def write_back(self) -> None:
        """Make the updated weights the working weights (all-gathered where the stage needs it)."""
        ...

    def host_bytes(self, optimizer: torch.optim.Optimizer | None) -> tuple[int, int]:
        """(master + optimizer state bytes in host memory, host staging buffer bytes)."""
        ...

    def device_buffer_bytes(self) -> int:
        """Staging buffers on the training device (the offloaded step's, when the GPU runs it)."""
        ...

    def flush(self) -> None:
        """Finish any update still in flight, so the masters, the optimizer state and the working weights
        agree (before a checkpoint or a full state dict reads them)."""
        ...

    def close(self) -> None: ...


def attach_master_grads(
    optimizer: torch.optim.Optimizer,
    groups: Sequence[FlatGroup],
    grads: Sequence[torch.Tensor] | None,
    *,
    per_tensor: bool,
) -> None:
    """Point the optimizer's parameters (one flat master per group, or one view per parameter) at the
    master gradients, or detach them (`grads=None`). `groups` may be a subset of the stage's (partial
    offload): a group's optimizer param group is the one at `group.index`."""
    for index, group in enumerate(groups):
        grad = None if grads is None else grads[index]
        if not per_tensor:
            group.master.grad = grad
            continue
        views = optimizer.param_groups[group.index]["params"]
        for view, slot in zip(views, group.layout.slots, strict=True):
            view.grad = None if grad is None else grad.narrow(0, slot.offset, slot.numel).view(view.shape)


class DeviceMasters:
    """Masters on the training device: the optimizer steps them where the gradients are."""

    def __init__(self, groups: Sequence[FlatGroup], zero: StageGroups) -> None:
        self.groups = list(groups)
        self.zero = zero

    def bind(self, optimizer: torch.optim.Optimizer | None) -> None:
        pass

    def prepare_step(self, optimizer: torch.optim.Optimizer, math: GradMath, *, per_tensor: bool) -> None:
        pass

    def begin_backward(self, *, boundary: bool) -> None:
        pass

    def run_backward(self, backward: Callable[[], None]) -> None:
        backward()

    def end_backward(self, *, boundary: bool) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer, math: GradMath, *, per_tensor: bool) -> GradResult:
        grads = master_grads_from(self.zero.grad_pieces(), [group.master for group in self.groups])
        result = finish_grads(grads, math)
        if result.overflow:
            return result
        attach_master_grads(optimizer, self.groups, grads, per_tensor=per_tensor)
        optimizer.step()
        attach_master_grads(optimizer, self.groups, None, per_tensor=per_tensor)
        return result

    def write_back(self) -> None:
        self.zero.write_back()

    def host_bytes(self, optimizer: torch.optim.Optimizer | None) -> tuple[int, int]:
        return self.zero.host_param_bytes(), 0  # working shards under offload_param (no optimizer's offload)

    def device_buffer_bytes(self) -> int:
        return 0

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
