"""DeepSpeed's ALST names (``deepspeed.runtime.sequence_parallel.ulysses_sp``) over runtime.sequence.

``TiledMLP.apply(fn, self, x, shards, compute_params)`` and ``TiledFusedLogitsLoss.apply(fn, self, x, y,
mask, shards, compute_params, output_reduction)`` keep DeepSpeed's call signatures (HF integrations and
ALST's tutorial call them so) and run our tiled functions. Differences, all in the user's favour: every
trainable parameter of ``self`` gets its gradient (``compute_params`` only adds weights ``fn`` uses that
``self`` does not own), each gradient is accumulated once per backward, and ``output_reduction="mean"``
averages over the tiles actually run (``torch.chunk`` may make fewer than ``shards``).

``UlyssesSPAttentionHF.register_with_transformers(...)`` (Accelerate's ``ParallelismConfig(sp_backend=
"deepspeed")`` path calls it) builds the sequence groups (runtime.sequence.sp_groups), installs Ulysses
attention (runtime.sequence.ulysses) under the model's attention implementation, and returns the ``mpu``;
``UlyssesSPDataLoaderAdapter`` is runtime.sequence.ulysses_data's ``SequenceShardLoader``. Bad input is a
one-line UserError where DeepSpeed raises ValueError/RuntimeError or asserts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from runtime.errors import UserError
from runtime.sequence.sp_groups import SequenceParallelGroups, init_sequence_parallel
from runtime.sequence.tiled_loss import tiled_loss
from runtime.sequence.tiled_mlp import tiled_mlp, trainable_params
from runtime.sequence.tiles import check_tiles
from runtime.sequence.ulysses import UlyssesAttention, install_ulysses
from runtime.sequence.ulysses_data import SequenceShardLoader

__all__ = ["TiledFusedLogitsLoss", "TiledMLP", "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]


class UlyssesSPAttentionHF(UlyssesAttention):
    """DeepSpeed's ``UlyssesSPAttentionHF``: Ulysses attention around ``attn`` over ``process_group``.
    The shape arguments DeepSpeed checks each call against are accepted; shapes are read from the tensors."""

    def __init__(
        self,
        attn: Callable[..., Any],
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group: Any,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
    ) -> None:
        fixed = None if seq_length_is_variable else global_seq_length
        super().__init__(attn, process_group, attn_head_count, kv_head_count, disable_in_eval, fixed)

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
    ) -> SequenceParallelGroups | None:
        """Build the sequence groups, make models with this config (a model, or a hub name / path whose
        config is read) run Ulysses attention, and return the ``mpu``; None at sequence_parallel_size 1."""
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise UserError(
                "register_with_transformers(seq_length_is_variable=False) needs seq_length",
                hint="pass seq_length=<tokens per sequence>, or seq_length_is_variable=True",
            )
        if seq_length is not None and seq_length % sequence_parallel_size:
            raise UserError(
                f"seq_length={seq_length} is not divisible by "
                f"sequence_parallel_size={sequence_parallel_size}",
                hint=f"pad sequences to a multiple of {sequence_parallel_size} tokens",
            )
        config = getattr(model_name_or_path, "config", None)
        if config is None:
            if not isinstance(model_name_or_path, str):
                raise UserError(
                    "register_with_transformers(model_name_or_path=...): a "
                    f"{type(model_name_or_path).__name__} has no HF config",
                    hint="pass the HF model, or its hub name or local path",
                )
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_name_or_path)
        mpu = init_sequence_parallel(sequence_parallel_size)
        fixed = None if seq_length_is_variable else seq_length  # then every batch must have this length
        group = mpu.get_sequence_parallel_group()
        install_ulysses(config, group, core_attn_implementation, disable_in_eval, fixed)
        return mpu


class UlyssesSPDataLoaderAdapter(SequenceShardLoader):
    """DeepSpeed's ``UlyssesSPDataLoaderAdapter(dl, sp_rank, sp_group, sp_world_size, device)``."""


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

        def tile_loss(xt: torch.Tensor, yt: torch.Tensor, mt: Any) -> torch.Tensor:
            return fn(self, xt, yt) if mt is None else fn(self, xt, yt, mt)

        return tiled_loss(tile_loss, x, y, shards, trainable_params(self, compute_params), mask, scale)
