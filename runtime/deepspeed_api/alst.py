"""DeepSpeed's ALST names (``deepspeed.runtime.sequence_parallel.ulysses_sp``) over runtime.sequence.

``TiledMLP.apply(fn, self, x, shards, compute_params)`` and ``TiledFusedLogitsLoss.apply(fn, self, x, y,
mask, shards, compute_params, output_reduction)`` keep DeepSpeed's call signatures (HF integrations and
ALST's tutorial call them so) and run our tiled functions. Differences, all in the user's favour: every
trainable parameter of ``self`` gets its gradient (``compute_params`` only adds weights ``fn`` uses that
``self`` does not own), each gradient is accumulated once per backward, and ``output_reduction="mean"``
averages over the tiles actually run (``torch.chunk`` may make fewer than ``shards``).

The Ulysses classes (``UlyssesSPAttentionHF``, ``UlyssesSPDataLoaderAdapter``) need the sequence axis of
the parallel plan (issue 34, after issue 31); until then they refuse by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from runtime.deepspeed_api.unsupported import unsupported_callable, unsupported_class
from runtime.errors import UserError
from runtime.sequence.tiled_loss import tiled_loss
from runtime.sequence.tiled_mlp import tiled_mlp, trainable_params
from runtime.sequence.tiles import check_tiles

__all__ = ["TiledFusedLogitsLoss", "TiledMLP", "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]

_ULYSSES = "sequence parallelism (Ulysses)"
_ULYSSES_ALTERNATIVE = (
    "planned, issue 34; on one GPU, long sequences train with the tiled MLP and loss and "
    "activation_checkpointing.cpu_checkpointing (README, Long sequences)"
)

UlyssesSPAttentionHF = unsupported_class("UlyssesSPAttentionHF", _ULYSSES, _ULYSSES_ALTERNATIVE)
# Accelerate's sp_backend="deepspeed" path calls this class method (after reading its signature) rather
# than constructing the class: it must exist and refuse by name, not fail as an AttributeError
UlyssesSPAttentionHF.register_with_transformers = staticmethod(  # type: ignore[attr-defined]
    unsupported_callable("register_with_transformers", _ULYSSES, _ULYSSES_ALTERNATIVE)
)
UlyssesSPDataLoaderAdapter = unsupported_class("UlyssesSPDataLoaderAdapter", _ULYSSES, _ULYSSES_ALTERNATIVE)


class TiledMLP:
    """DeepSpeed's ``TiledMLP``: ``TiledMLP.apply(fn, self, x, shards, compute_params=None)`` returns
    ``fn(self, x)`` over ``shards`` tiles of ``x``'s sequence axis (see runtime.sequence.tiled_mlp)."""

    @staticmethod
    def apply(
        fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
        self: nn.Module,
        x: torch.Tensor,
        shards: int,
        compute_params: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return tiled_mlp(fn, self, x, check_tiles(shards, "TiledMLP.apply(shards=...)"), compute_params)


def _tiles_made(tokens: int, shards: int) -> int:
    """How many pieces ``torch.chunk(tokens, shards)`` makes (fewer than ``shards`` when it rounds up)."""
    size = -(-tokens // shards)
    return max(1, -(-tokens // max(size, 1)))


class TiledFusedLogitsLoss:
    """DeepSpeed's ``TiledFusedLogitsLoss``: ``apply(fn, self, x, y, mask, shards, compute_params,
    output_reduction)`` returns the sum (``"sum"``) or the mean over tiles (``"mean"``) of
    ``fn(self, x_tile, y_tile[, mask_tile])``, where tiles cut ``x`` ``[batch, seq, ...]`` and ``y``/``mask``
    ``[batch, seq]`` flattened over tokens. The full logits never exist (runtime.sequence.tiled_loss)."""

    @staticmethod
    def apply(
        fn: Callable[..., torch.Tensor],
        self: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        shards: int,
        compute_params: list[torch.Tensor] | None = None,
        output_reduction: str = "mean",
    ) -> torch.Tensor:
        if output_reduction not in ("mean", "sum"):
            raise UserError(
                f"TiledFusedLogitsLoss.apply(output_reduction=...): expected 'mean' or 'sum', got "
                f"{output_reduction!r}",
                hint='use "sum" and divide by the number of counted tokens when tiles count unequally',
            )
        shards = check_tiles(shards, "TiledFusedLogitsLoss.apply(shards=...)")
        tokens = x.shape[0] * x.shape[1] if x.dim() >= 2 else 0
        scale = 1.0 / _tiles_made(tokens, shards) if output_reduction == "mean" else 1.0

        def tile_loss(xt: torch.Tensor, yt: torch.Tensor, mt: torch.Tensor | None) -> torch.Tensor:
            return fn(self, xt, yt) if mt is None else fn(self, xt, yt, mt)

        return tiled_loss(tile_loss, x, y, shards, trainable_params(self, compute_params), mask, scale)
