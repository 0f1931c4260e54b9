"""The tiled MLP: a per-token module run over tiles of the sequence, each tile recomputed in backward.

A transformer MLP at sequence length S holds ``S x intermediate_size`` activations several times over
(gate, up, their product), which at 100K+ tokens dwarfs the weights. Per-token modules need no other token,
so the forward can run tile by tile under ``no_grad`` keeping only its input, and the backward re-runs one
tile at a time with grad, so only one tile's intermediates are ever alive.

Gradients: each tile's backward is ``torch.autograd.grad`` with respect to the tile's input and the
module's parameters; the parameter gradients are summed over tiles (in fp32 for 16-bit parameters) and
returned as the function's own outputs. Autograd therefore accumulates each parameter's gradient once per
backward, exactly like an untiled module, and every gradient hook (ZeRO's reduce, DDP's buckets) fires
once. DeepSpeed's version accumulates into ``.grad`` tile by tile and needs a flag on each parameter to
hold ZeRO back; ours needs none.

ZeRO-3: the parameters must be whole while the tiles run. In a HF model the MLP sits inside a decoder
layer, which ZeRO-3 gathers as one unit for the layer's forward and (through its output hooks) for its
backward, so both the forward tiles and the recomputation see full weights. The recomputation runs
in backward, where the engine never releases a unit before its gradients arrive. No collective runs per
tile, so ranks with different sequence lengths (different tile counts) cannot hang each other.

Limits: the module must be per-token (no mixing along the sequence) and deterministic (no dropout: the
recomputation does not replay the RNG).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from runtime.errors import UserError
from runtime.sequence.tiles import TileGradSums, check_tiles, mlp_tiles

__all__ = ["TileCount", "tile_llama_mlps", "tile_mlp", "tiled_mlp", "trainable_params"]

TileCount = int | str  # a positive int, or "auto" (mlp_tiles: ceil(seqlen / hidden_size))

MlpFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class _TiledMLPFunction(torch.autograd.Function):
    """forward(fn, module, x, tiles, *params): ``fn(module, tile)`` over tiles of ``x`` along dim -2."""

    @staticmethod
    def forward(ctx: Any, fn: MlpFn, module: nn.Module, x: torch.Tensor, tiles: int, *params: Any) -> Any:
        ctx.fn, ctx.module, ctx.tiles = fn, module, tiles
        # the parameters are kept by reference, not saved: ZeRO-3 swaps their storage between forward and
        # backward, which a saved tensor's version check would refuse
        ctx.params = params
        ctx.save_for_backward(x)
        with torch.no_grad():
            outputs = [fn(module, tile) for tile in x.chunk(tiles, dim=-2)]
        return torch.cat(outputs, dim=-2)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[2]
        wanted = [i for i, p in enumerate(ctx.params) if ctx.needs_input_grad[4 + i]]
        grad_x = torch.empty_like(x) if want_x else None
        sums = TileGradSums(ctx.params)
        x_tiles = x.chunk(ctx.tiles, dim=-2)
        g_tiles = grad_out.chunk(ctx.tiles, dim=-2)
        gx_tiles = grad_x.chunk(ctx.tiles, dim=-2) if grad_x is not None else [None] * len(x_tiles)
        for tile, g_tile, gx_tile in zip(x_tiles, g_tiles, gx_tiles, strict=True):
            tile = tile.detach().requires_grad_(want_x)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, tile)
            inputs = ([tile] if want_x else []) + [ctx.params[i] for i in wanted]
            grads = list(torch.autograd.grad(out, inputs, g_tile, allow_unused=True))
            if gx_tile is not None:  # there is a tile of grad_x exactly when want_x
                gx_tile.copy_(grads.pop(0))
            sums.add(wanted, grads)
        return (None, None, grad_x, None, *sums.result())


def trainable_params(module: nn.Module, extra: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The trainable parameters of ``module`` and ``extra``, each once, in a fixed order."""
    seen: dict[int, torch.Tensor] = {}
    for p in list(module.parameters()) + list(extra or []):
        if p.requires_grad:
            seen.setdefault(id(p), p)
    return list(seen.values())


def _resolve(tiles: TileCount, x: torch.Tensor, argument: str) -> int:
    if tiles == "auto":
        return mlp_tiles(x.shape[-2], x.shape[-1])
    return check_tiles(tiles, argument)


def tiled_mlp(
    fn: MlpFn,
    module: nn.Module,
    x: torch.Tensor,
    tiles: TileCount = "auto",
    params: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``fn(module, x)`` computed over tiles of ``x``'s sequence axis (dim -2), each tile recomputed in
    backward. Gradients reach ``x`` and every trainable parameter of ``module`` (plus ``params``, for
    weights ``fn`` uses that ``module`` does not own). ``x`` is ``[batch, seq, hidden]`` or
    ``[tokens, hidden]``; ``tiles`` is a positive int or ``"auto"`` (``ceil(seq / hidden)``); more tiles
    than tokens is fine (one token per tile)."""
    if x.dim() < 2:
        raise UserError(
            f"tiled_mlp: x must be [..., seq, hidden], got shape {tuple(x.shape)}",
            hint="pass the hidden states the MLP receives",
        )
    count = _resolve(tiles, x, "tiled_mlp(tiles=...)")
    return _TiledMLPFunction.apply(fn, module, x, count, *trainable_params(module, params))


def _plain_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # looked up on the module at each call (not captured), so a deep copy of a tiled module runs its own
    # weights: copy.deepcopy rebinds bound-method attributes to the copy
    return module._dslaunch_plain_forward(x)  # type: ignore[operator]


def _tiled_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return tiled_mlp(_plain_forward, self, x, self._dslaunch_tiles)  # type: ignore[arg-type]


def tile_mlp(mlp: nn.Module, tiles: TileCount = "auto") -> nn.Module:
    """Make ``mlp`` (any per-token module taking ``[..., seq, hidden]``) run tiled, in place: its own
    ``forward`` is kept and called per tile, so parameter names and the state dict do not change. Returns
    ``mlp``. Tiling twice is a no-op."""
    if tiles != "auto":
        check_tiles(tiles, "tile_mlp(tiles=...)")
    if getattr(mlp, "_dslaunch_tiles", None) is not None:
        mlp._dslaunch_tiles = tiles  # type: ignore[assignment]
        return mlp
    mlp._dslaunch_tiles = tiles  # type: ignore[assignment]
    # the bound forward of its class (or whatever the user had put there), called once per tile
    mlp._dslaunch_plain_forward = mlp.forward  # type: ignore[assignment]
    mlp.forward = types.MethodType(_tiled_forward, mlp)
    return mlp


def tile_llama_mlps(model: nn.Module, tiles: TileCount = "auto") -> int:
    """Tile the MLP of every decoder layer of a HF Llama-style model (``model.model.layers[i].mlp``, also
    Mistral, Qwen2/3, Gemma, ...); returns how many were tiled. With ``"auto"`` each call picks
    ``ceil(seq / hidden_size)`` tiles from the hidden states it receives."""
    if tiles != "auto":
        check_tiles(tiles, "tile_llama_mlps(tiles=...)")
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None or not all(hasattr(layer, "mlp") for layer in layers):
        raise UserError(
            f"tile_llama_mlps: {type(model).__name__} has no model.layers[i].mlp",
            hint="tile each MLP module with runtime.sequence.tile_mlp(module) instead",
        )
    for layer in layers:
        tile_mlp(layer.mlp, tiles)
    return len(layers)
