"""A GPT-2-style decoder: the example model for training jobs, tests and benchmarks.

This module owns the model definition and its size arithmetic (parameter count and training FLOPs per
token), nothing about how it is trained or sharded. The shape follows GPT-2: learned token and position
embeddings, ``n_layer`` pre-LayerNorm blocks (causal self-attention through
``torch.nn.functional.scaled_dot_product_attention``, then a 4x GELU MLP), a final LayerNorm and an output
head tied to the token embedding.

Two choices exist for the sake of the runtime rather than the model:

- Each block is its own ``nn.Module`` in ``GPT.blocks`` so that ZeRO-3 can gather parameters block by block
  and activation checkpointing can wrap whole blocks: set ``model.checkpoint_fn`` (for example to
  ``runtime.activation_checkpointing.checkpoint``) and each block runs as ``checkpoint_fn(block, x)``.
- The output head is its own ``nn.Linear`` module whose weight *is* the token embedding's ``Parameter``
  (one object, registered under two modules). A gatherer that works module by module (DeepSpeed's ZeRO-3)
  then sees the head's weight used inside the head's own forward, and ``parameters()`` yields it once.
  ``Module.to_empty`` replaces each registration with its own tensor, so ``init_weights`` ties them again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

# GPT-2's 50257-token vocabulary padded to a multiple of 64, which keeps the embedding and head matmuls on
# fast tensor-core shapes. Use vocab_size=50257 for GPT-2's exact parameter counts.
GPT2_PADDED_VOCAB = 50304


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT model. ``max_seq_len`` is the number of learned positions (GPT-2: 1024)."""

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = GPT2_PADDED_VOCAB
    max_seq_len: int = 1024
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @classmethod
    def named(cls, name: str, **overrides: Any) -> GPTConfig:
        """The config of a named size (``tiny``, ``small``/``gpt2``, ``medium``, ``large``, ``xl``).

        ``overrides`` replace single fields, e.g. ``GPTConfig.named("tiny", vocab_size=256)``.
        """
        key = _SIZE_ALIASES.get(name, name)
        if key not in MODEL_SIZES:
            known = ", ".join(sorted(set(MODEL_SIZES) | set(_SIZE_ALIASES)))
            raise ValueError(f"unknown model size {name!r}; known sizes: {known}")
        return replace(MODEL_SIZES[key], **overrides)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def num_params(self) -> int:
        """Parameters of the model, tied head counted once; computed without building the model."""
        d, v, t = self.n_embd, self.vocab_size, self.max_seq_len
        b = 1 if self.bias else 0
        layer_norm = 2 * d  # LayerNorm keeps its bias even when the linears have none, as in GPT-2
        attention = d * 3 * d + b * 3 * d + d * d + b * d
        mlp = d * 4 * d + b * 4 * d + 4 * d * d + b * d
        block = 2 * layer_norm + attention + mlp
        return v * d + t * d + self.n_layer * block + layer_norm

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6N for the matmuls of forward and backward plus 12·L·d·T for attention.

        The attention term counts the causal score and value matmuls in full (the PaLM convention), so
        TFLOP/s figures compare with published MFU numbers. N counts every parameter, embeddings included.
        """
        t = self.max_seq_len if seq_len is None else seq_len
        return 6.0 * self.num_params() + 12.0 * self.n_layer * self.n_embd * t


MODEL_SIZES: dict[str, GPTConfig] = {
    # ~0.86M parameters with a byte vocabulary: trains visibly in seconds on one CPU core.
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=256, max_seq_len=256),
    "small": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
}
_SIZE_ALIASES = {"gpt2": "small", "gpt2-medium": "medium", "gpt2-large": "large", "gpt2-xl": "xl"}


class GPTOutput(NamedTuple):
    """What ``GPT.forward`` returns: logits ``(B, T, vocab)`` and the mean loss (``None`` without targets)."""

    logits: torch.Tensor
    loss: torch.Tensor | None


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # (B, T, 3, H, Dh) -> three (B, H, T, Dh) views; SDPA picks flash attention on GPU for bf16/fp16.
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(b, t, d)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-style language model. ``forward(idx, targets=None) -> GPTOutput(logits, loss)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        # None: blocks run plainly; else each block runs as checkpoint_fn(block, x) (activation checkpointing)
        self.checkpoint_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
        if self.tok_emb.weight.device.type != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's initialisation; call it again after ``to_empty`` when the model was built on ``meta``.

        Every linear and embedding weight is N(0, 0.02). The two projections that write into the residual
        stream in each block get std 0.02/sqrt(2·n_layer), so the residual's variance does not grow with
        depth (GPT-2 paper, section 2.3).
        """
        self.lm_head.weight = self.tok_emb.weight  # (re)tie: to_empty gives each registration its own tensor
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(("attn.proj", "mlp.proj")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> GPTOutput:
        _, t = idx.shape
        if t > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {t} is longer than the model's max_seq_len {self.config.max_seq_len}"
            )
        positions = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x) if self.checkpoint_fn is None else self.checkpoint_fn(block, x)
        x = self.ln_f(x)
        logits = self.lm_head(x)
        if targets is None:
            return GPTOutput(logits, None)
        # In fp32 even under autocast: a bf16 log-softmax over 50k classes loses most of the loss's digits.
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return GPTOutput(logits, loss)

    def num_params(self) -> int:
        """Parameters actually allocated, the tied head once (equals ``config.num_params()``)."""
        return sum(p.numel() for p in self.parameters())
