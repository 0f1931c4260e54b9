"""The gradient norm across the whole grid, each weight counted once: the one place that looks across the
data, pipe and model axes (DESIGN.md "one grid").

The step's gradient math (`runtime.precision`) sums this rank's squared gradients and hands the sum to an
`all_reduce_sum` hook; `grid_square_sum` builds that hook from the grid's facts:

1. parameters whole on every model rank (replicated: norms, embeddings, row-wise biases, an mpu's unmarked
   weights) would count once per model rank, so (tp - 1) / tp of their squares are taken off first;
2. the sum over data, when gradients are sharded there (`dp_sum`; None when every data rank holds them all);
3. the tied copies a pipeline stage holds but does not own (their squares, already summed over data, whole
   on every model rank, so 1/tp per model rank);
4. the sum over the pipe axis, then over the model axis.

Pure arithmetic on one tensor plus collectives; the engines pass the facts in (no engine import here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

SquareSum = Callable[[torch.Tensor], None]


def grid_square_sum(
    dp_sum: SquareSum | None,
    *,
    model_size: int = 1,
    model_group: Any = None,
    pipe_size: int = 1,
    pipe_group: Any = None,
    replicated: Callable[[], torch.Tensor | None] | None = None,
    duplicates: Callable[[], torch.Tensor | None] | None = None,
) -> SquareSum | None:
    """The hook that turns this rank's sum of squared gradients into the grid's, in place. `replicated`:
    the squares of this rank's replicated parameters (read when the hook runs: the gradients are reduced
    by then); `duplicates`: the squares of the tied copies this stage does not own. Returns `dp_sum`
    itself when the grid has no pipe or model axis and no ties."""
    if model_size == 1 and pipe_size == 1 and duplicates is None:
        return dp_sum

    def reduce(squared: torch.Tensor) -> None:
        if model_size > 1 and replicated is not None:
            squares = replicated()
            if squares is not None:
                squared.sub_(squares.to(squared.dtype) * (model_size - 1) / model_size)
        if dp_sum is not None:
            dp_sum(squared)
        copies = duplicates() if duplicates is not None else None
        if copies is not None:  # tied copies are whole on every model rank
            squared.sub_(copies.to(squared.dtype) / model_size)
        if pipe_size > 1:
            dist.all_reduce(squared, group=pipe_group)
        if model_size > 1:
            dist.all_reduce(squared, group=model_group)

    return reduce


__all__ = ["SquareSum", "grid_square_sum"]
