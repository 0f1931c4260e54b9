"""RMSNorm that keeps its 16-bit input for backward instead of an fp32 copy: a long sequence's largest
per-token saving after the tiled MLP and loss.

Hugging Face's ``LlamaRMSNorm`` (and Mistral's, Qwen2/3's, ...) upcasts its input to fp32 and lets autograd
save what its ops need: the fp32 input (4 bytes a hidden element) and the 16-bit normalized value (2 more),
in every decoder layer twice, for the whole of that layer's backward; its backward then makes fp32
gradients of the same size. At 65K tokens of the 1B shape under one GPU's long-sequence setup that was
the largest single share of what a layer's backward held (BENCHMARKS.md, "What the GPU held at its
peak": two 512 MiB fp32 copies of a 256 MiB input).

`lean_rms_norm` computes the same forward, op for op on each row (its output is bitwise the module's),
and saves only the 16-bit input and one fp32 number a token (the reciprocal RMS). Both passes run a tile
of rows at a time (about ``hidden`` tokens a tile, as the tiled MLP cuts them), so their fp32 temporaries
are one tile's: HF's forward holds 10 bytes a hidden element of the whole sequence at once (the fp32
input, the fp32 normalized value and its 16-bit cast), and with checkpointing that forward runs again
inside backward, where the 1B shape's peak sat (BENCHMARKS.md, "Long sequences": the lean norm's own
forward, untiled, was 3 of its 13 GiB at 131K tokens). Backward sums the weight's gradient over tiles in
fp32. The gradients are the module's in exact
arithmetic; in floating point they are as close as two orders of the same fp32 sums (tested).

`lean_llama_norms(model)` swaps the forward of every RMSNorm-like module (a ``weight`` and a
``variance_epsilon``) of a model in place; parameter names and the state dict do not change.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from runtime.errors import UserError
from runtime.sequence.tiles import mlp_tiles

__all__ = ["lean_llama_norms", "lean_norm", "lean_rms_norm"]


def _tile_rows(count: int, hidden: int) -> int:
    """Rows a tile: about `hidden`, as the tiled MLP cuts a sequence (at least 1: an empty input, no loop)."""
    return max(1, -(-count // mlp_tiles(count, hidden)))


class _LeanRMSNorm(torch.autograd.Function):
    """forward(x, weight, eps): HF's RMSNorm; backward recomputes the normalized rows tile by tile."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # HF's LlamaRMSNorm, op for op on each row, so the output is bitwise its output; a tile of rows at a
        # time, so the fp32 temporaries (10 bytes a hidden element) are one tile's, not the sequence's
        hidden = x.shape[-1]
        rows = x.reshape(-1, hidden)
        count = rows.shape[0]
        size = _tile_rows(count, hidden)
        if size >= count:
            upcast = rows.to(torch.float32)
            rstd = torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)
            out = weight * (upcast * rstd).to(x.dtype)
        else:
            out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
            rstd = torch.empty(count, 1, dtype=torch.float32, device=x.device)
            for start in range(0, count, size):
                stop = min(count, start + size)
                upcast = rows[start:stop].to(torch.float32)
                scale = torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)
                out[start:stop] = weight * (upcast * scale).to(x.dtype)
                rstd[start:stop] = scale
        ctx.save_for_backward(x, rstd, weight)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        x, rstd, weight = ctx.saved_tensors
        want_x, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        hidden = x.shape[-1]
        rows = x.reshape(-1, hidden)
        grads = grad_out.reshape(-1, hidden)
        scales = rstd.reshape(-1, 1)
        grad_x = torch.empty_like(rows) if want_x else None
        grad_weight = torch.zeros(hidden, dtype=torch.float32, device=x.device) if want_weight else None
        count = rows.shape[0]
        size = _tile_rows(count, hidden)
        for start in range(0, count, size):
            stop = min(count, start + size)
            upcast, scale, g = rows[start:stop].to(torch.float32), scales[start:stop], grads[start:stop]
            normed = (upcast * scale).to(x.dtype)
            if grad_weight is not None:  # d(weight * normed) / d weight, as autograd's mul gives it
                grad_weight += (g * normed).to(torch.float32).sum(0)
            if grad_x is not None:
                # through weight * normed (whose gradient autograd rounds to normed's dtype), the cast back
                # to 16 bits, and upcast * rsqrt(mean(upcast^2) + eps)
                g_normed = (g * weight).to(x.dtype).to(torch.float32)
                dot = (g_normed * upcast).mean(-1, keepdim=True)
                grad_x[start:stop] = (scale * g_normed - upcast * (scale.pow(3) * dot)).to(x.dtype)
        return (
            grad_x.view_as(x) if grad_x is not None else None,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            None,
        )


def lean_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` computed as HF's LlamaRMSNorm computes it, saving for backward only `x` and
    one fp32 number a row (see the module docstring). `x` is ``[..., hidden]``; `weight` is ``[hidden]``."""
    return _LeanRMSNorm.apply(x, weight, eps)


def _lean_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return lean_rms_norm(x, self.weight, float(self.variance_epsilon))  # type: ignore[arg-type]


def _is_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and hasattr(module, "variance_epsilon")
        and getattr(module, "bias", None) is None
        and "rmsnorm" in type(module).__name__.lower()
    )


def lean_norm(norm: nn.Module) -> nn.Module:
    """Make one RMSNorm-like module (a 1-D ``weight``, a ``variance_epsilon``, HF's arithmetic) keep only
    its 16-bit input for backward, in place; returns it. Twice is a no-op."""
    if not _is_rms_norm(norm):
        raise UserError(
            f"lean_norm: {type(norm).__name__} is not an RMSNorm with a weight and a variance_epsilon",
            hint="pass a HF *RMSNorm module (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, ...)",
        )
    norm.forward = types.MethodType(_lean_forward, norm)
    return norm


def lean_llama_norms(model: nn.Module) -> int:
    """Swap every RMSNorm of a HF Llama-style model (the layers' two and the final one) for `lean_norm`'s;
    returns how many. A model without any is refused: nothing would change."""
    norms = [module for module in model.modules() if _is_rms_norm(module)]
    if not norms:
        raise UserError(
            f"lean_llama_norms: {type(model).__name__} has no RMSNorm module (a *RMSNorm class with a 1-D "
            "weight and a variance_epsilon)",
            hint="call runtime.sequence.lean_rms_norm(x, weight, eps) in the model's own norm instead",
        )
    for norm in norms:
        lean_norm(norm)
    return len(norms)
