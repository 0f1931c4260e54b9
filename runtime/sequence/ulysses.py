"""Ulysses attention: each rank holds a shard of the sequence; attention sees the whole sequence, some heads.

Everything outside attention (embeddings, norms, MLP, the loss) is per token, so a rank computes it on its
own sequence shard alone. Attention mixes tokens, so around it two all-to-alls move the data:

- before: q, k, v ``[batch, heads, seq/sp, dim]`` (this rank's tokens, all heads) become
  ``[batch, heads/sp, seq, dim]`` (every token, this rank's heads);
- the core attention (HF's function registered under the model's implementation, e.g. ``sdpa``) runs
  causal over the whole sequence;
- after: its output ``[batch, seq, heads/sp, dim]`` goes back to ``[batch, seq/sp, heads, dim]``.

The exchange is ``all_to_all_single`` with equal splits (gloo has it, as NCCL does) inside an
autograd.Function whose backward is the same exchange of the gradient (an equal-split all-to-all is its own
transpose), so gradients reach the rank that owns each token and each head.

Grouped-query attention: with kv heads a multiple of sp each rank takes kv_heads/sp of them; with fewer kv
heads than sp (sp a multiple of kv_heads) each kv head is repeated sp/kv_heads times before the exchange,
so each rank gets the one its query heads use. Any other count is refused in one line.

Before the first layer's exchange, ``check_shards`` refuses (on every rank of the group alike) shards of
different lengths, which the equal-split all-to-all cannot pair, and whole sequences fed without the data
loader adapter, which would attend over sp copies of each sequence.

``install_ulysses(model.config, group)`` makes an unmodified HF model run this: it replaces the entry of
``transformers``' ``ALL_ATTENTION_FUNCTIONS`` under the model's own implementation name with a wrapper, so
every code path HF keys on that name (mask building, kernels) stays as it is and only the call to
attention is intercepted. The masks HF builds are for the local shard and are dropped: attention is
causal over the gathered sequence, so padding inside a sequence must be masked through the labels (-100);
packed documents stay apart only under kernels that read the gathered ``position_ids`` (flash varlen), not
under ``sdpa``. The entry is per process: every model there running that implementation runs Ulysses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from runtime.errors import UserError

__all__ = [
    "UlyssesAttention",
    "check_heads",
    "check_shards",
    "heads_to_sequence",
    "install_ulysses",
    "sequence_to_heads",
    "ulysses_exchange",
]


class _Exchange(torch.autograd.Function):
    """Equal-split all-to-all over dim 0 (chunk i goes to rank i of ``group``); backward: the same."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def ulysses_exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Send ``x[i]`` to rank i of ``group`` and return what each rank sent here, stacked in rank order."""
    return _Exchange.apply(x, group)


def sequence_to_heads(x: torch.Tensor, sp: int, group: Any) -> torch.Tensor:
    """``[batch, heads, seq/sp, dim]`` (this rank's tokens) -> ``[batch, heads/sp, seq, dim]`` (its heads)."""
    b, h, s_local, d = x.shape
    # rank r gets heads r*h/sp .. (r+1)*h/sp-1 of every rank's tokens
    chunks = x.reshape(b, sp, h // sp, s_local, d).permute(1, 0, 2, 3, 4)
    got = ulysses_exchange(chunks, group)  # [source rank = sequence chunk, b, h/sp, s/sp, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s_local, d)


def heads_to_sequence(x: torch.Tensor, sp: int, group: Any) -> torch.Tensor:
    """``[batch, seq, heads/sp, dim]`` (its heads) -> ``[batch, seq/sp, heads, dim]`` (this rank's tokens)."""
    b, s, h_local, d = x.shape
    chunks = x.reshape(b, sp, s // sp, h_local, d).permute(1, 0, 2, 3, 4)
    got = ulysses_exchange(chunks, group)  # [source rank = head group, b, s/sp, h/sp, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // sp, sp * h_local, d)


def check_heads(heads: int, kv_heads: int, sp: int) -> None:
    """A UserError naming the config key when the heads cannot be split over ``sp`` ranks."""
    if heads % sp:
        raise UserError(
            f"num_attention_heads={heads} is not divisible by sequence_parallel_size={sp}",
            hint="choose a sequence_parallel_size that divides the model's attention heads",
        )
    if kv_heads % sp and sp % kv_heads:
        raise UserError(
            f"num_key_value_heads={kv_heads} and sequence_parallel_size={sp}: neither divides the other",
            hint="choose a sequence_parallel_size that divides, or is a multiple of, the key/value heads",
        )


def check_shards(local_len: int, position_ids: Any, sp: int, group: Any, device: torch.device) -> None:
    """Refuse, on every rank of ``group`` alike, shards the exchange would silently mix up or hang on.

    Costs one all-gather of two integers per forward (callers run it at the first layer only): each rank's
    shard length, and whether its ``position_ids`` are HF's default ``0..len-1``. Different lengths would
    make the equal-split all-to-all fail or hang; every rank at positions ``0..len-1`` means whole sequences
    (or shards without their positions) reached the model without the data loader adapter, so each rank
    would attend over sp copies of its sequence. (Packed documents of exactly ``len`` tokens each, cut at
    the shard borders, look the same; that layout is refused too.)"""
    default = isinstance(position_ids, torch.Tensor) and bool(
        torch.equal(position_ids, torch.arange(local_len, device=position_ids.device).expand_as(position_ids))
    )
    mine = torch.tensor([local_len, int(default)], dtype=torch.long, device=device)
    parts = [torch.empty_like(mine) for _ in range(sp)]
    dist.all_gather(parts, mine, group=group)
    lengths = [int(p[0]) for p in parts]
    if len(set(lengths)) > 1:
        raise UserError(
            f"Ulysses: the sequence group's shards differ in length ({lengths} tokens, in group rank order)",
            hint="shard each batch with UlyssesSPDataLoaderAdapter (or shard_batch), which cuts equal shards",
        )
    if all(int(p[1]) for p in parts):
        raise UserError(
            f"Ulysses: every rank of the sequence group got positions 0..{local_len - 1}: whole sequences "
            "(or shards without their position_ids) reached a model registered for sequence parallelism",
            hint="feed the model through UlyssesSPDataLoaderAdapter, which cuts each sequence and passes "
            "its position_ids",
        )


class UlyssesAttention:
    """The attention function HF calls (``fn(module, q, k, v, mask, **kwargs) -> (out, weights)``), run
    across the sequence group around ``core`` (the function HF had registered for the implementation)."""

    def __init__(
        self,
        core: Callable[..., Any],
        group: Any,
        heads: int,
        kv_heads: int,
        disable_in_eval: bool = False,
        seq_length: int | None = None,
    ) -> None:
        self.core = core
        self.seq_length = seq_length  # the one global length allowed (seq_length_is_variable=False)
        self.group = group
        self.sp = dist.get_world_size(group)
        check_heads(heads, kv_heads, self.sp)
        self.heads = heads
        self.kv_heads = kv_heads
        self.kv_repeat = self.sp // kv_heads if kv_heads < self.sp else 1
        self.disable_in_eval = disable_in_eval

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        if self.sp == 1 or (self.disable_in_eval and not module.training):
            return self.core(module, query, key, value, attention_mask, *args, **kwargs)
        if query.shape[1] != self.heads:
            # a model whose config says otherwise (head-pruned, or another model under the same name)
            raise UserError(
                f"Ulysses attention was registered for {self.heads} heads, this layer has {query.shape[1]}",
                hint="register each model with its own config (register_with_transformers)",
            )
        if getattr(module, "layer_idx", 0) in (0, None):
            local = query.shape[2]
            if self.seq_length is not None and local * self.sp != self.seq_length:
                raise UserError(
                    f"this batch's sequence shard has {local} tokens, {local * self.sp} over {self.sp} "
                    f"ranks, but Ulysses was registered with seq_length={self.seq_length} and "
                    "seq_length_is_variable=False",
                    hint=f"pad or cut every sequence to {self.seq_length} tokens, or register with "
                    "seq_length_is_variable=True",
                )
            check_shards(query.shape[2], kwargs.get("position_ids"), self.sp, self.group, query.device)
        if self.kv_repeat > 1:
            key = key.repeat_interleave(self.kv_repeat, dim=1)
            value = value.repeat_interleave(self.kv_repeat, dim=1)
        q = sequence_to_heads(query, self.sp, self.group)
        k = sequence_to_heads(key, self.sp, self.group)
        v = sequence_to_heads(value, self.sp, self.group)
        position_ids = kwargs.get("position_ids")
        if isinstance(position_ids, torch.Tensor):
            # flash kernels find packed sequences from the positions: they need the whole sequence's
            parts = [torch.empty_like(position_ids) for _ in range(self.sp)]
            dist.all_gather(parts, position_ids.contiguous(), group=self.group)
            kwargs["position_ids"] = torch.cat(parts, dim=-1)
        # the mask HF built is for the local shard; causal over the gathered sequence is what we want
        groups_before = getattr(module, "num_key_value_groups", None)
        if groups_before is not None:
            # HF repeats kv heads by this ratio; with replicated kv heads the local ratio differs
            module.num_key_value_groups = q.shape[1] // k.shape[1]  # type: ignore[assignment]
        try:
            out, weights = self.core(module, q, k, v, None, *args, **kwargs)
        finally:
            if groups_before is not None:
                module.num_key_value_groups = groups_before
        return heads_to_sequence(out, self.sp, self.group), weights


def install_ulysses(
    config: Any,
    group: Any,
    implementation: str | None = None,
    disable_in_eval: bool = False,
    seq_length: int | None = None,
) -> UlyssesAttention:
    """Make models with this HF ``config`` run Ulysses over ``group``: the entry of
    ``ALL_ATTENTION_FUNCTIONS`` under the config's attention implementation (``implementation``, which must
    then match it; ``sdpa`` when the config names none) becomes a ``UlyssesAttention`` around the function
    it held. ``seq_length``: the only global length it then accepts (None: any). Returns it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model_impl = getattr(config, "_attn_implementation", None)
    name = implementation or model_impl or "sdpa"
    if model_impl is not None and model_impl != name:
        raise UserError(
            f"core_attn_implementation={name!r} but the model runs attn_implementation={model_impl!r}",
            hint=f"load the model with attn_implementation={name!r}, or pass {model_impl!r}",
        )
    if name in ("eager", "paged|eager"):
        raise UserError(
            f"core_attn_implementation={name!r}: eager attention needs the full [seq, seq] mask, "
            "which Ulysses does not build",
            hint='use "sdpa" or a flash attention implementation',
        )
    if name not in ALL_ATTENTION_FUNCTIONS:
        raise UserError(
            f"core_attn_implementation={name!r} is not an attention implementation transformers knows",
            hint=f"choose one of {sorted(ALL_ATTENTION_FUNCTIONS.valid_keys())}",
        )
    core = ALL_ATTENTION_FUNCTIONS[name]
    if isinstance(core, UlyssesAttention):  # registered before: wrap what it wrapped
        core = core.core
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    attention = UlyssesAttention(core, group, heads, kv_heads, disable_in_eval, seq_length)
    ALL_ATTENTION_FUNCTIONS[name] = attention
    if model_impl is None:
        config._attn_implementation = name
    return attention
