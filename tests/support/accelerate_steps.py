"""An Accelerate training loop over prepared objects, as its users write it, for in-process tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def train_prepared(
    accelerator: Any, model: Any, optimizer: Any, loader: Any, after_step: Callable[[], None] | None = None
) -> list[float]:
    """One step per batch of `loader` (rows of token ids, the labels the inputs); each step's loss on this
    rank. `after_step` runs after each step (to read counters, say)."""
    losses = []
    for (ids,) in loader:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if after_step is not None:
            after_step()
    return losses
