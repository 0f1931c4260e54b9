"""Tiny transformer blocks in the two layouts AutoTP plans for, shared by the tensor-parallel tests.

`GPT2Block` uses Hugging Face's Conv1D (weight stored (in, out), fused q|k|v in `c_attn`); `LlamaBlock`
uses nn.Linear projections with grouped-query attention. `TinyLM` stacks either kind; `lm_batch` and
`lm_loss` are its data and loss, and `layers_3d` the same blocks as pipeline layer specs with a tied
embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, KV_HEADS, VOCAB, SEQ = 16, 4, 2, 13, 6


class Conv1D(nn.Module):
    """Hugging Face's Conv1D layout: weight (in, out), y = x @ W + b, output size `nf`."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = (*x.size()[:-1], self.nf)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class GPT2Attention(nn.Module):
    def __init__(self, heads: int = HEADS) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.split_size = heads, DIM // heads, DIM
        self.c_attn = Conv1D(3 * DIM, DIM)
        self.c_proj = Conv1D(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            part.view(b, t, -1, self.head_dim).transpose(1, 2)
            for part in self.c_attn(x).split(self.split_size, dim=2)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(b, t, -1))


class GPT2MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = Conv1D(4 * DIM, DIM)
        self.c_proj = Conv1D(DIM, 4 * DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, heads: int = HEADS) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(DIM), GPT2Attention(heads)
        self.ln_2, self.mlp = nn.LayerNorm(DIM), GPT2MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LlamaAttention(nn.Module):
    """Grouped-query attention: HEADS query heads share KV_HEADS key/value heads."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.num_heads, self.num_key_value_heads = HEADS, KV_HEADS
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.v_proj = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        repeat = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class LlamaMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(DIM, 2 * DIM, bias=False)
        self.up_proj = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down_proj = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = nn.LayerNorm(DIM), LlamaAttention()
        self.post_attention_layernorm, self.mlp = nn.LayerNorm(DIM), LlamaMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLM(nn.Module):
    def __init__(self, block: type[nn.Module], layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.h = nn.ModuleList(block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(900 + 31 * step + dp_rank)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).reshape(-1, VOCAB), labels.reshape(-1))


def layers_3d() -> list:
    from runtime.pipe import LayerSpec, TiedLayerSpec
    from tests.support.pipe_cases import VOCAB as PIPE_VOCAB
    from tests.support.pipe_cases import head_forward

    return [
        TiedLayerSpec("embed", nn.Embedding, PIPE_VOCAB, DIM),
        LayerSpec(GPT2Block),
        LayerSpec(LlamaBlock),
        LayerSpec(nn.LayerNorm, DIM),
        TiedLayerSpec("embed", nn.Embedding, PIPE_VOCAB, DIM, forward_fn=head_forward),
    ]


def pipeline_3d(partition_method: str, chunks_per_stage: int = 1):
    """`layers_3d` as a pp2 x tp2 (dp1) PipelineModule: a tied embedding and head, seeded layers, the
    token loss (a 4-rank job)."""
    from runtime.parallel import PipeModelDataParallelTopology
    from runtime.pipe import PipelineModule
    from tests.support.pipe_cases import BASE_SEED, token_loss

    return PipelineModule(
        layers_3d(),
        topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1),
        loss_fn=token_loss,
        seed_layers=True,
        base_seed=BASE_SEED,
        partition_method=partition_method,
        chunks_per_stage=chunks_per_stage,
    )
