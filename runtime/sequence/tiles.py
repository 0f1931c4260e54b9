"""How many tiles a long sequence is cut into (the pure rules), and how the parameters' gradients are summed
over the tiles: what the tiled MLP and the tiled loss share.

A *tile* is a contiguous run of tokens along the sequence axis; the last one may be shorter (sizes as
``torch.chunk`` makes them). The rules here pick the count from shapes alone, so every rank of a job picks
the same count for the same shapes (a rank that ran fewer tiles than its peers would stop gathering ZeRO-3
parameters early and hang them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from runtime.errors import UserError

__all__ = ["LOGITS_TILE_BYTES", "TileGradSums", "check_tiles", "loss_tiles", "mlp_tiles"]

# The size of one tile's fp32 logits in the tiled loss (ALST's choice: about 1 GiB per shard keeps the
# kernels large while the full [tokens, vocab] tensor, tens of GiB at 100K+ tokens, never exists).
LOGITS_TILE_BYTES = 1 << 30


def check_tiles(tiles: object, argument: str) -> int:
    """`tiles` as a positive int, or a one-line UserError naming `argument`."""
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise UserError(
            f"{argument}: expected a positive number of tiles, got {tiles!r}",
            hint='pass an integer >= 1, or "auto" to choose it from the sequence length',
        )
    return tiles


def mlp_tiles(seqlen: int, hidden_size: int) -> int:
    """The tiled MLP's default tile count: ``ceil(seqlen / hidden_size)`` (DeepSpeed's rule), at least 1.

    Each tile then holds about ``hidden_size`` tokens, so its intermediate activations
    (``tokens x intermediate_size``) are about the size of one ``hidden x intermediate`` weight: the MLP's
    peak memory no longer grows with the sequence. A sequence shorter than the hidden size is one tile
    (the plain MLP's cost, recomputed once in backward)."""
    return max(1, math.ceil(seqlen / max(1, hidden_size)))


def loss_tiles(tokens: int, vocab_size: int, tile_bytes: int = LOGITS_TILE_BYTES) -> int:
    """The tiled loss's default tile count: fp32 logits of at most ``tile_bytes`` per tile, at least 1."""
    return max(1, math.ceil(tokens * vocab_size * 4 / tile_bytes))


class TileGradSums:
    """The parameters' gradients summed over tiles: a 16-bit gradient in fp32, rounded once at the end, as
    one untiled matmul rounds its gradient once."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self._sums: list[torch.Tensor | None] = [None] * len(self.params)

    def add(self, wanted: Sequence[int], grads: Sequence[torch.Tensor | None]) -> None:
        """One tile's gradients of the parameters at indices `wanted` (None: unused by this tile)."""
        for i, g in zip(wanted, grads, strict=True):
            if g is None:
                continue
            running = self._sums[i]
            if running is None:
                self._sums[i] = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
            else:
                running.add_(g)

    def result(self, zero_if_none: Sequence[int] = ()) -> list[torch.Tensor | None]:
        """Each parameter's sum in its own dtype; None where no tile gave one, but a zero gradient for the
        indices in `zero_if_none` (what the untiled computation would give them)."""
        out: list[torch.Tensor | None] = []
        for i, (total, p) in enumerate(zip(self._sums, self.params, strict=True)):
            if total is None:
                out.append(torch.zeros_like(p) if i in zero_if_none else None)
            else:
                out.append(total.to(p.dtype))
        return out
