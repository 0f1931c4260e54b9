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

`GradMath` carries what the engine knows about the step's gradient arithmetic (how many ranks and
micro-steps the sums span, the loss scale, the clipping norm, and whether a norm is needed at all), so a
placement can apply it wherever its gradients are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from runtime.precision.mixed import GradResult, finish_grads, master_grads_from
from runtime.zero.flat import FlatGroup


@dataclass(frozen=True)
class GradMath:
    """The gradient arithmetic of one step (see `runtime.precision.mixed.finish_grads`)."""

    divisor: float  # ranks x micro-steps the reduced sums span, after any pre-reduce scaling
    loss_scale: float  # fp16 loss scale of the backward passes (1.0 otherwise)
    max_norm: float  # clip to this global norm; 0 = no clipping
    check_overflow: bool  # decide on inf/nan (fp16)
    want_norm: bool  # compute the norm even without clipping or overflow checks (logging)
    all_reduce_sum: Callable[[torch.Tensor], Any] | None  # sums over ranks when gradients are sharded

    @property
    def needs_norm(self) -> bool:
        return self.max_norm > 0 or self.check_overflow or self.want_norm

    @property
    def factor_before_backward(self) -> float | None:
        """The factor every gradient is multiplied by, when it is known before the gradients are (no
        clipping, no overflow check): what lets an offloaded update start while backward still runs."""
        if self.max_norm > 0 or self.check_overflow:
            return None
        return 1.0 / (self.divisor * self.loss_scale)


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

    def __init__(self, groups: Sequence[FlatGroup], zero: Any) -> None:
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
        result = finish_grads(
            grads,
            divisor=math.divisor,
            loss_scale=math.loss_scale,
            max_norm=math.max_norm,
            check_overflow=math.check_overflow,
            want_norm=math.want_norm,
            all_reduce_sum=math.all_reduce_sum,
        )
        if result.overflow:
            return result
        attach_master_grads(optimizer, self.groups, grads, per_tensor=per_tensor)
        optimizer.step()
        attach_master_grads(optimizer, self.groups, None, per_tensor=per_tensor)
        return result

    def write_back(self) -> None:
        self.zero.write_back()

    def host_bytes(self, optimizer: torch.optim.Optimizer | None) -> tuple[int, int]:
        return 0, 0

    def device_buffer_bytes(self) -> int:
        return 0

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def scale_from_device_grads(
    pieces: Sequence[Sequence[torch.Tensor]], math: GradMath
) -> tuple[GradResult, float]:
    """The norm and overflow decision from the reduced gradients on the device, and the one factor the
    host multiplies the landed gradients by (average over ranks and micro-steps, unscale, clip).

    Same arithmetic as `finish_grads`, without touching the gradients."""
    inv = 1.0 / (math.divisor * math.loss_scale)
    if not math.needs_norm:
        return GradResult(None, False), inv
    flat = [piece for group in pieces for piece in group]
    norms = [torch.linalg.vector_norm(piece, dtype=torch.float32) for piece in flat]
    squared = torch.stack(norms).square().sum()
    if math.all_reduce_sum is not None:
        math.all_reduce_sum(squared)
    norm = squared.sqrt_().mul_(inv)
    if math.check_overflow and not bool(torch.isfinite(norm)):
        return GradResult(norm, True), inv
    if math.max_norm <= 0:
        return GradResult(norm, False), inv
    clip = float((math.max_norm / (norm + 1e-6)).clamp_(max=1.0))  # the host needs this number: one sync
    return GradResult(norm, False), clip * inv
