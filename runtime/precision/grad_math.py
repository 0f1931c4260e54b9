"""The gradient arithmetic of an optimizer step: what goes in (`GradMath`), what comes out (`GradResult`),
and the two ways of applying it.

Between the reduced gradients and the optimizer update every placement does the same arithmetic: the
global norm (one fused kernel per group, plus one all-reduce when gradients are sharded), the decision on
a non-finite norm (the step's only host sync; what a skipped step does: nonfinite.py), and one factor
that folds together the averaging over ranks and micro-steps, the loss-scale unscale and the clipping
coefficient. Nothing else in the step waits for the device.

- `finish_grads` applies it to fp32 master gradients in place (masters on the device).
- `device_grad_verdict` computes the same norm and verdict from the gradients where the ZeRO stage
  reduced them, without waiting for the device: the verdict as a device flag and the factor (a device
  tensor when it needs the norm), for a step that multiplies as it updates and skips inside its kernel
  (the fused master step, which reads the verdict after its launch); `scale_from_device_grads` reads both,
  for a placement that multiplies elsewhere (the optimizer offload's host step).

The engines build a `GradMath` for each step (runtime/engine.py `_grad_math`; the pipeline and
model-parallel engines widen its `all_reduce_sum` over their grid); the placements in runtime/offload/
take it to wherever their gradients are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class GradMath:
    """The gradient arithmetic of one step, as the engine knows it before the gradients exist."""

    divisor: float  # ranks x micro-steps the reduced sums span, after any pre-reduce scaling
    loss_scale: float  # fp16 loss scale of the backward passes (1.0 otherwise)
    max_norm: float  # clip to this global norm; 0 = no clipping
    check_overflow: bool  # decide on inf/nan (fp16, or bf16's non-finite check); costs the one host sync
    want_norm: bool  # compute the norm even without clipping or overflow checks (logging)
    # sums a tensor over ranks in place when this rank's gradients are shards; None when every rank
    # holds the full gradients
    all_reduce_sum: Callable[[torch.Tensor], Any] | None

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

    @property
    def factor_before_verdict(self) -> float | None:
        """The factor, when only the non-finite verdict is left to wait for (no clipping): a checked step
        may update before the verdict where it can take the update back (offload/step/speculative.py)."""
        if self.max_norm > 0:
            return None
        return 1.0 / (self.divisor * self.loss_scale)


@dataclass(frozen=True)
class GradResult:
    """Outcome of a step's gradient arithmetic: the global gradient norm (unscaled, before clipping) and
    the overflow verdict."""

    norm: torch.Tensor | None  # 0-dim fp32 tensor on the device, or None when nobody needed it
    overflow: bool  # the norm is not finite: the step must be skipped


def master_grads_from(
    pieces: Sequence[Sequence[torch.Tensor]], masters: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """One contiguous master-dtype gradient per group from that group's reduced pieces (shard order).

    A single piece already in the master dtype is used as is (fp32 training: no copy); otherwise the
    pieces are cast into a fresh buffer that lives until the optimizer step is done.
    """
    grads: list[torch.Tensor] = []
    for group_pieces, master in zip(pieces, masters, strict=True):
        if len(group_pieces) == 1 and group_pieces[0].dtype == master.dtype:
            grads.append(group_pieces[0].view(master.shape))
            continue
        grad = torch.empty_like(master)
        offset, views = 0, []
        for piece in group_pieces:
            views.append(grad.narrow(0, offset, piece.numel()))
            offset += piece.numel()
        if offset != master.numel():
            raise AssertionError(
                f"gradient pieces cover {offset} elements, master shard has {master.numel()}"
            )
        # one multi-tensor cast-copy: one rank's gradients come as a piece per parameter (zero/one_rank.py)
        torch._foreach_copy_(views, [piece.reshape(-1) for piece in group_pieces])
        grads.append(grad)
    return grads


def finish_grads(grads: Sequence[torch.Tensor], math: GradMath) -> GradResult:
    """Average, unscale and clip fp32 master gradients in place.

    `grads` are this rank's fp32 master gradients (one tensor per group), summed over ranks and
    micro-steps and still multiplied by the loss scale; `math` says over how many, by what scale, to
    which norm, and how to sum over ranks. On overflow the gradients are left untouched.
    """
    inv = 1.0 / (math.divisor * math.loss_scale)
    norm = None
    if math.needs_norm:
        norms = torch._foreach_norm(list(grads))
        squared = torch.stack(norms).square().sum() if len(norms) > 1 else norms[0].square()
        if math.all_reduce_sum is not None:
            math.all_reduce_sum(squared)
        norm = squared.sqrt_().mul_(inv)
    if math.check_overflow:
        assert norm is not None
        if not bool(torch.isfinite(norm)):  # the one host sync of the step
            return GradResult(norm, True)
    if math.max_norm > 0:
        assert norm is not None
        coef = (math.max_norm / (norm + 1e-6)).clamp_(max=1.0).mul_(inv)
        torch._foreach_mul_(list(grads), coef)
    elif inv != 1.0:
        torch._foreach_mul_(list(grads), inv)
    return GradResult(norm, False)


def device_grad_verdict(
    pieces: Sequence[torch.Tensor], math: GradMath
) -> tuple[torch.Tensor | None, torch.Tensor | None, float | torch.Tensor]:
    """`finish_grads`' arithmetic on the reduced gradients where they are (any dtype), without touching
    them and without waiting for the device: the norm (None when nothing needs it), the verdict as a 0-d
    fp32 device tensor, 1 where the norm is finite and 0 where not (None without the check), and the one
    factor to multiply them by (averaging over ranks and micro-steps, unscale, clip). The factor is a 0-d
    device tensor when clipping makes it depend on the norm."""
    inv = 1.0 / (math.divisor * math.loss_scale)
    if not math.needs_norm:
        return None, None, inv
    # one multi-tensor kernel: one rank's gradients may come as a piece per parameter (zero/one_rank.py)
    norms = torch._foreach_norm(list(pieces), 2, dtype=torch.float32)
    squared = torch.stack(norms).square().sum()
    if math.all_reduce_sum is not None:
        math.all_reduce_sum(squared)
    norm = squared.sqrt_().mul_(inv)
    finite = torch.isfinite(norm).to(torch.float32) if math.check_overflow else None
    if math.max_norm <= 0:
        return norm, finite, inv
    return norm, finite, (math.max_norm / (norm + 1e-6)).clamp_(max=1.0).mul_(inv)


def scale_from_device_grads(
    pieces: Sequence[Sequence[torch.Tensor]], math: GradMath
) -> tuple[GradResult, float]:
    """The norm and overflow decision from the reduced gradients on the device (read: one host sync), and
    the one factor the caller multiplies the gradients by elsewhere (average over ranks and micro-steps,
    unscale, clip), as a number: with clipping, reading it is one more sync."""
    norm, finite, factor = device_grad_verdict([piece for group in pieces for piece in group], math)
    if finite is not None and not bool(finite):
        return GradResult(norm, True), 1.0 / (math.divisor * math.loss_scale)
    return GradResult(norm, False), float(factor)


def pre_reduce_scale(config: Any, world_size: int) -> float:
    """Gradient scaling before the reduction, DeepSpeed's way: prescale_gradients divides by the world size
    up front; otherwise gradient_predivide_factor (default 1) is divided out before and the rest after."""
    if world_size == 1:
        return 1.0
    if config.prescale_gradients:
        return 1.0 / world_size
    return 1.0 / config.gradient_predivide_factor
