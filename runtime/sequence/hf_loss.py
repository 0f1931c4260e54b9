"""The tiled loss inside a Hugging Face causal LM: ``model(input_ids, labels=...)`` without the full logits.

``tile_causal_lm_loss(model)`` replaces the instance's ``forward`` (the class and the state dict are
untouched): with ``labels`` (or HF's pre-shifted ``shift_labels``) it runs the base model
(``model.model``), then ``tiled_causal_lm_loss`` on the last hidden states and ``model.lm_head``, and
returns HF's output with the loss and ``logits=None``; without labels (generation, evaluation of logits)
the original forward runs. ``num_items_in_batch``, which the HF Trainer passes under gradient accumulation,
is honoured. Models whose head does more than a linear map (Gemma-2's logit soft-capping) are refused.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Protocol

from torch import nn

from runtime.errors import UserError
from runtime.sequence.tiled_loss import tiled_causal_lm_loss
from runtime.sequence.tiles import check_tiles

__all__ = ["tile_causal_lm_loss"]


class _TiledLM(Protocol):
    """What the tiled forward reads from the model it is bound to (set by ``tile_causal_lm_loss``)."""

    model: nn.Module
    lm_head: nn.Linear
    _dslaunch_plain_lm_forward: Callable[..., Any]  # the forward it replaced
    _dslaunch_output_class: Callable[..., Any]  # transformers' CausalLMOutputWithPast
    _dslaunch_loss_tiles: int | str


def _tiled_forward(self: _TiledLM, *args: Any, **kwargs: Any) -> Any:
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    if args or (labels is None and shift_labels is None):
        # positional calls and calls without labels keep HF's own path
        if labels is not None:
            kwargs["labels"] = labels
        if shift_labels is not None:
            kwargs["shift_labels"] = shift_labels
        return self._dslaunch_plain_lm_forward(*args, **kwargs)
    num_items = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("logits_to_keep", None)
    kwargs.pop("return_dict", None)
    outputs = self.model(**kwargs)
    head = self.lm_head
    loss = tiled_causal_lm_loss(
        outputs.last_hidden_state,
        head.weight,
        shift_labels if shift_labels is not None else labels,
        bias=head.bias,
        tiles=self._dslaunch_loss_tiles,
        shift=shift_labels is None,
        num_items_in_batch=num_items,
    )
    result = self._dslaunch_output_class(loss=loss, logits=None)
    for key, value in outputs.items():
        if key != "last_hidden_state":
            result[key] = value
    return result


def tile_causal_lm_loss(model: nn.Module, tiles: int | str = "auto") -> nn.Module:
    """Make a HF causal LM (``model.model`` + ``model.lm_head``: Llama, Mistral, Qwen, ...) compute its
    training loss tiled, in place; returns ``model``. ``tiles``: a positive int, or ``"auto"`` (fp32 logits
    of at most 1 GiB per tile)."""
    if tiles != "auto":
        check_tiles(tiles, "tile_causal_lm_loss(tiles=...)")
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or not isinstance(getattr(model, "model", None), nn.Module):
        raise UserError(
            f"tile_causal_lm_loss: {type(model).__name__} has no model.model and linear model.lm_head",
            hint="compute the loss with runtime.sequence.tiled_causal_lm_loss(hidden, head.weight, labels)",
        )
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None):
        raise UserError(
            f"tile_causal_lm_loss: {type(model).__name__} soft-caps its logits "
            "(config.final_logit_softcapping), which the tiled loss does not do",
            hint="set config.final_logit_softcapping to None, or keep the model's own loss",
        )
    if getattr(model, "_dslaunch_plain_lm_forward", None) is None:
        # imported here, not at the top: runtime needs transformers only for HF models
        from transformers.modeling_outputs import CausalLMOutputWithPast

        model._dslaunch_output_class = CausalLMOutputWithPast  # type: ignore[assignment]
        model._dslaunch_plain_lm_forward = model.forward  # type: ignore[assignment]
        model.forward = types.MethodType(_tiled_forward, model)
    model._dslaunch_loss_tiles = tiles  # type: ignore[assignment]
    return model
