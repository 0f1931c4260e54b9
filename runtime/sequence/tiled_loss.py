"""The tiled logits loss: the language-model head and cross-entropy over token tiles, never the full logits.

At S tokens and a vocabulary of V the logits are ``S x V`` floats (Llama-3 at 128K tokens: 62 GiB in fp32)
plus as much again for their gradient. Here the forward runs tile by tile: a tile's logits, its loss and,
at once, its gradients with respect to the tile's hidden states and the head's weights (``autograd.grad``
inside the forward, so the logits are dropped before the next tile). The forward keeps the input gradient
(the size of the hidden states) and the weight gradient summed over tiles (in fp32 for 16-bit weights);
the backward only scales them by the incoming gradient. Like the tiled MLP, the weight gradients are the
function's outputs, so autograd accumulates them once and ZeRO's gradient hooks fire once, in backward.

``tiled_causal_lm_loss`` is the causal-LM loss of HF models: labels shifted left by one (the last position
padded with ``ignore_index``, so the hidden states are never sliced or copied), the sum of per-token
cross-entropies in fp32 divided by the number of counted labels (or ``num_items_in_batch``, as HF passes
under gradient accumulation). A batch whose labels are all ignored gives loss 0 and zero gradients (the
plain ``F.cross_entropy`` mean gives NaN there); a tile whose labels are all ignored is skipped.

ZeRO-3: the head's weight is used outside the head module's own forward, so it is gathered for the
duration of the forward (``runtime.zero.GatheredParameters``; free when the weight is whole).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.errors import UserError
from runtime.sequence.tiles import TileGradSums, check_tiles, loss_tiles
from runtime.zero import GatheredParameters

__all__ = ["tiled_causal_lm_loss", "tiled_loss"]

# fn(x_tile, y_tile, mask_tile or None) -> a scalar, or None when the tile contributes nothing
TileLoss = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], "torch.Tensor | None"]


def _tiles_of(t: torch.Tensor | None, tiles: int, made: int) -> list[Any]:
    """``t`` cut like the hidden states (``made`` pieces: torch.chunk may make fewer than ``tiles``)."""
    if t is None:
        return [None] * made
    return list(t.chunk(tiles, dim=0))


class _TiledLossFunction(torch.autograd.Function):
    """forward(fn, x, y, mask, tiles, tile_scale, *params) -> sum over tiles of tile_scale * fn(tile).

    ``x``, ``y`` and ``mask`` are flat over tokens (dim 0)."""

    @staticmethod
    def forward(
        ctx: Any,
        fn: TileLoss,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        tiles: int,
        tile_scale: float,
        *params: Any,
    ) -> torch.Tensor:
        want_x = x.requires_grad
        wanted = [i for i, p in enumerate(params) if p.requires_grad]
        grad_x = torch.zeros_like(x) if want_x else None
        sums = TileGradSums(params)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        x_tiles = x.chunk(tiles, dim=0)
        gx_tiles = grad_x.chunk(tiles, dim=0) if grad_x is not None else [None] * len(x_tiles)
        made = len(x_tiles)
        pieces = zip(x_tiles, _tiles_of(y, tiles, made), _tiles_of(mask, tiles, made), gx_tiles, strict=True)
        for tile, y_tile, m_tile, gx_tile in pieces:
            tile = tile.detach().requires_grad_(want_x)
            with torch.enable_grad():
                out = fn(tile, y_tile, m_tile)
                if out is None:
                    continue
                out = out.float() * tile_scale
            total += out.detach()
            if not out.requires_grad:
                continue
            inputs = ([tile] if want_x else []) + [params[i] for i in wanted]
            grads = list(torch.autograd.grad(out, inputs, allow_unused=True))
            if gx_tile is not None:  # there is a tile of grad_x exactly when want_x
                gx_tile.copy_(grads.pop(0))
            sums.add(wanted, grads)
        ctx.grad_x = grad_x
        # every tile skipped: a zero gradient, as the untiled loss would give
        ctx.param_grads = sums.result(zero_if_none=wanted)
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> Any:
        def scaled(g: torch.Tensor | None) -> torch.Tensor | None:
            return None if g is None else g * grad_total.to(g.dtype)

        grad_x, param_grads = scaled(ctx.grad_x), [scaled(g) for g in ctx.param_grads]
        ctx.grad_x = ctx.param_grads = None  # one backward: free the stored gradients now
        return (None, grad_x, None, None, None, None, *param_grads)


def tiled_loss(
    fn: TileLoss,
    x: torch.Tensor,
    y: torch.Tensor,
    tiles: int,
    params: list[torch.Tensor],
    mask: torch.Tensor | None = None,
    tile_scale: float = 1.0,
) -> torch.Tensor:
    """``sum over tiles of tile_scale * fn(x_tile, y_tile, mask_tile)`` in fp32, with the gradients with
    respect to ``x`` and ``params`` computed tile by tile in the forward. ``x`` ``[batch, seq, ...]``, ``y``
    and ``mask`` ``[batch, seq]`` are flattened over tokens and cut into ``tiles`` (the last one shorter when
    it does not divide). Under ``no_grad`` nothing is kept for backward."""
    check_tiles(tiles, "tiled_loss(tiles=...)")
    if x.dim() < 2 or x.shape[:2] != y.shape[:2] or (mask is not None and mask.shape != y.shape[:2]):
        raise UserError(
            f"tiled loss: hidden states {tuple(x.shape)}, labels {tuple(y.shape)}"
            + (f" and mask {tuple(mask.shape)}" if mask is not None else "")
            + " do not share [batch, seq]",
            hint="pass hidden states [batch, seq, hidden] and labels [batch, seq]",
        )
    tokens = x.shape[0] * x.shape[1]
    flat_x = x.reshape(tokens, *x.shape[2:])
    flat_y = y.reshape(tokens, *y.shape[2:])
    flat_m = mask.reshape(tokens) if mask is not None else None
    params = [p for p in params if isinstance(p, torch.Tensor)]
    if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in params)):
        with torch.no_grad():
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            x_tiles = flat_x.chunk(tiles)
            made = len(x_tiles)
            ys, ms = _tiles_of(flat_y, tiles, made), _tiles_of(flat_m, tiles, made)
            for t, yt, mt in zip(x_tiles, ys, ms, strict=True):
                out = fn(t, yt, mt)
                if out is not None:
                    total += out.float() * tile_scale
            return total
    return _TiledLossFunction.apply(fn, flat_x, flat_y, flat_m, tiles, tile_scale, *params)


def tiled_causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    tiles: int | str = "auto",
    shift: bool = True,
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """The causal-LM loss ``cross_entropy(hidden @ weight.T (+ bias), labels)`` (mean over counted labels)
    without the full logits.

    Args:
        hidden: the last hidden states ``[batch, seq, hidden]`` (after the final norm).
        weight: the LM head's weight ``[vocab, hidden]`` (``model.lm_head.weight``).
        labels: ``[batch, seq]``; ``ignore_index`` entries do not count.
        tiles: a positive int, or ``"auto"``: fp32 logits of at most 1 GiB per tile.
        shift: True (HF causal LMs): position t predicts label t+1; False: labels are already shifted.
        num_items_in_batch: divide by this instead of the number of counted labels (HF's gradient
            accumulation normalisation).
    """
    if labels.shape != hidden.shape[:2]:
        raise UserError(
            f"tiled_causal_lm_loss: labels {tuple(labels.shape)} do not match hidden states "
            f"{tuple(hidden.shape)} in [batch, seq]",
            hint="pass labels [batch, seq] for hidden states [batch, seq, hidden]",
        )
    if shift:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    tokens = labels.numel()
    count = tiles if tiles != "auto" else loss_tiles(tokens, weight.shape[0])
    count = check_tiles(count, "tiled_causal_lm_loss(tiles=...)")

    # which tiles count any label, read with one device synchronization for all of them (the tiles are
    # visited once each, in order, by the forward or the no-grad path)
    flags = torch.stack([(t != ignore_index).any() for t in labels.reshape(-1).chunk(count)])
    counting = iter(flags.tolist())

    def tile_loss(x: torch.Tensor, y: torch.Tensor, _mask: torch.Tensor | None) -> torch.Tensor | None:
        if not next(counting):
            return None  # nothing counts here: no logits at all
        logits = F.linear(x, weight, bias).float()
        return F.cross_entropy(logits, y, ignore_index=ignore_index, reduction="sum")

    # only parameters are gathered (a plain tensor is whole on every rank already)
    with GatheredParameters([p for p in (weight, bias) if isinstance(p, nn.Parameter)]):
        total = tiled_loss(tile_loss, hidden, labels, count, [weight] + ([bias] if bias is not None else []))
    if num_items_in_batch is None:
        counted = (labels != ignore_index).sum().clamp(min=1)
        return total / counted
    return total / num_items_in_batch
