"""Ulysses data: batches cut along the sequence for the ranks of one sequence group, and the loss over them.

``shard_batch`` (pure) is what one rank keeps of a batch: ``labels`` become ``shift_labels`` (each token's
label is the next token's, -100 after the last) BEFORE the cut, since the token that predicts the first
token of shard r+1 sits at the end of shard r; ``position_ids`` (``0 .. seq-1`` per row when the batch has
none) are cut with the rest, so rotary embeddings see global positions. Tensors ``[batch, seq, ...]`` are
cut on dim 1; anything else is kept whole.

``SequenceShardLoader`` wraps the DataLoader of each rank (DeepSpeed's ``UlyssesSPDataLoaderAdapter``):
the sp ranks of a group each draw one batch, exchange them, and then train on them one after the other,
each rank on its shard of each. So it yields sp micro-batches per batch drawn (its length is ``len(dl) *
sp``) and, over sp steps, the group trains on exactly the batches data parallelism would have.

``reduce_sequence_loss`` gives the mean over the whole sequence from each rank's summed loss and count of
counted tokens (so a shard whose labels are all -100 counts as zero tokens, not as a NaN mean); its
gradient is this rank's share only, so summing gradients over the sequence group gives the gradient of
the mean.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from runtime.errors import UserError

__all__ = ["IGNORE_INDEX", "SequenceShardLoader", "reduce_sequence_loss", "shard_batch", "shift_labels"]

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """``labels[:, 1:]`` with -100 appended: position i's target is token i+1."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def shard_batch(batch: Mapping[str, Any], sp_rank: int, sp_size: int) -> dict[str, Any]:
    """This rank's part of ``batch`` (``input_ids`` ``[batch, seq]`` required; see the module docstring)."""
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() < 2:
        raise UserError(
            "sequence parallelism: each batch needs input_ids, a [batch, seq] tensor",
            hint="have the collator return a dict with input_ids (and labels, position_ids)",
        )
    seq = input_ids.shape[1]
    if seq % sp_size:
        raise UserError(
            f"sequence length {seq} is not divisible by sequence_parallel_size={sp_size}",
            hint=f"pad every batch to a multiple of {sp_size} tokens (labels -100 on the padding)",
        )
    out = dict(batch)
    if "labels" in out:
        out["shift_labels"] = shift_labels(out.pop("labels"))
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(seq, device=input_ids.device).expand(input_ids.shape[0], seq)
    chunk = seq // sp_size
    cut = slice(chunk * sp_rank, chunk * (sp_rank + 1))
    for name, value in out.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            if value.shape[1] != seq:
                raise UserError(
                    f"sequence parallelism: batch[{name!r}] has {value.shape[1]} positions, input_ids {seq}",
                    hint="every per-token tensor of a batch must be [batch, seq, ...]",
                )
            out[name] = value[:, cut].contiguous()
    return out


def reduce_sequence_loss(loss_sum: torch.Tensor, tokens: torch.Tensor | int, group: Any) -> torch.Tensor:
    """The mean loss over the sequence group's tokens: ``sum(loss_sum) / sum(tokens)`` over ``group``.

    ``loss_sum``: this rank's summed per-token loss (a 0-dim tensor with a graph); ``tokens``: its number of
    counted (not -100) tokens. The value is the same on every rank; the gradient flows through this rank's
    ``loss_sum`` only (scaled by 1 / total tokens): gradients summed over ``group`` are those of the mean."""
    count = torch.as_tensor(tokens, dtype=torch.float32, device=loss_sum.device).reshape(())
    totals = torch.stack([loss_sum.detach().float(), count])
    dist.all_reduce(totals, group=group)
    local = loss_sum.float()
    return (local + (totals[0] - local.detach())) / totals[1].clamp(min=1)


class SequenceShardLoader:
    """DeepSpeed's ``UlyssesSPDataLoaderAdapter``: yields this rank's shard of each batch of its sequence
    group, sp micro-batches per batch drawn (see the module docstring)."""

    def __init__(
        self, dl: Iterable[Any], sp_rank: int, sp_group: Any, sp_world_size: int, device: Any
    ) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = torch.device(device) if device is not None else None
        self._iter: Iterator[Any] | None = None
        self._ready: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size  # type: ignore[arg-type]

    def __iter__(self) -> SequenceShardLoader:
        self._iter = iter(self.dl)
        self._ready.clear()
        return self

    def __next__(self) -> dict[str, Any]:
        if self._iter is None:
            self._iter = iter(self.dl)
        if not self._ready:
            self._refill(next(self._iter))
        return self._ready.popleft()

    def _refill(self, batch: Any) -> None:
        if not isinstance(batch, Mapping):
            raise UserError(
                f"sequence parallelism: the DataLoader yields {type(batch).__name__}, not a dict",
                hint="have the collator return a dict with input_ids (and labels, position_ids)",
            )
        # the batches of the group's ranks may differ in length: exchange them whole (a few tensors per
        # step, and only token ids), then cut each
        batches: list[Any] = [None] * self.sp_world_size
        dist.all_gather_object(batches, {k: _to_cpu(v) for k, v in batch.items()}, group=self.sp_group)
        for drawn in batches:
            shard = shard_batch(drawn, self.sp_rank, self.sp_world_size)
            if self.device is not None:
                shard = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in shard.items()}
            self._ready.append(shard)


def _to_cpu(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) else value
