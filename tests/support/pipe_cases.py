"""Tiny pipeline models, their data, and the single-process PyTorch reference the pipeline tests compare with.

The models are layer lists for `PipelineModule` (an MLP, and a GPT-like stack whose embedding and output
head share one weight). `reference_train` builds the same layers with the same per-layer seeds
(`seed_layers=True`) into one plain module and trains it on the whole global batch of every micro-step:
mean loss over the global micro-batch, gradients accumulated over micro-batches and averaged, clipped
with torch.nn.utils.clip_grad_norm_, a torch optimizer. Data: each micro-batch is a fixed global batch;
data-parallel rank d of D takes rows [d*R/D, (d+1)*R/D).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.pipe import LayerSpec, TiedLayerSpec

WIDTH, IN, OUT = 16, 6, 4
VOCAB, DIM, SEQ = 11, 8, 5
BASE_SEED = 77


class Block(nn.Module):
    """A residual MLP block (what "type:Block" partitions over)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class InFlightRecorder:
    """A layer that logs "F" when a micro-batch passes forward and "B" when its gradient comes back."""

    log: list[str] = []  # noqa: RUF012 - one log per worker process, reset per case

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        InFlightRecorder.log.append("F")
        if x.requires_grad:
            x.register_hook(lambda grad: InFlightRecorder.log.append("B"))
        return x

    @staticmethod
    def max_in_flight() -> int:
        alive = peak = 0
        for event in InFlightRecorder.log:
            alive += 1 if event == "F" else -1
            peak = max(peak, alive)
        return peak


def mlp_layers(depth: int = 4) -> list[Any]:
    """Linear(IN, WIDTH), the in-flight recorder, tanh, (Linear(WIDTH, WIDTH), tanh) x (depth - 2),
    Linear(WIDTH, OUT): 2 * depth items."""
    layers: list[Any] = [LayerSpec(nn.Linear, IN, WIDTH), InFlightRecorder(), torch.tanh]
    for _ in range(depth - 2):
        layers += [LayerSpec(nn.Linear, WIDTH, WIDTH), torch.tanh]
    layers.append(LayerSpec(nn.Linear, WIDTH, OUT))
    return layers


def head_forward(embedding: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()


def gpt_layers() -> list[Any]:
    return [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM),
        LayerSpec(Block, DIM),
        LayerSpec(Block, DIM),
        LayerSpec(Block, DIM),
        LayerSpec(nn.LayerNorm, DIM),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=head_forward),
    ]


def mse(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs.float(), labels)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def global_micro_batch(kind: str, step: int, micro: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5_000 + 131 * step + micro)
    if kind == "gpt":
        tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(rows, IN, generator=gen), torch.randn(rows, OUT, generator=gen)


def data_iterator(
    kind: str, step: int, micro_batches: int, rows: int, dp_rank: int, dp_size: int
) -> Iterator[Any]:
    per = rows // dp_size
    for micro in range(micro_batches):
        x, y = global_micro_batch(kind, step, micro, rows)
        yield x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per]


class ReferenceModel(nn.Module):
    """All layers of a layer list in one module, built with PipelineModule's per-layer seeds and names."""

    def __init__(self, layers: list[Any], base_seed: int = BASE_SEED) -> None:
        super().__init__()
        self.tied_modules = nn.ModuleDict()
        self.funcs: list[Any] = []
        for index, layer in enumerate(layers):
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    torch.manual_seed(base_seed + index)
                    self.tied_modules[layer.key] = layer.build()
                module, fn = self.tied_modules[layer.key], layer.forward_fn
                self.funcs.append((lambda x, m=module, f=fn: m(x) if f is None else f(m, x)))
            elif isinstance(layer, LayerSpec):
                torch.manual_seed(base_seed + index)
                module = layer.build()
                self.add_module(str(index), module)
                self.funcs.append(module)
            elif isinstance(layer, InFlightRecorder):
                continue
            else:
                self.funcs.append(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fn in self.funcs:
            x = fn(x)
        return x


@dataclass
class Reference:
    losses: list[float] = field(default_factory=list)  # per step: mean over micro-batches
    norms: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    initial: dict[str, torch.Tensor] = field(default_factory=dict)


def make_optimizer(kind: str, params: Any, lr: float) -> torch.optim.Optimizer:
    if kind == "Adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def layers_of(kind: str, depth: int = 4) -> list[Any]:
    return gpt_layers() if kind == "gpt" else mlp_layers(depth)


def reference_train(
    kind: str,
    *,
    depth: int = 4,
    steps: int,
    micro_batches: int,
    rows: int,
    optimizer: str,
    lr: float,
    clip: float,
    dtype: torch.dtype = torch.float32,
    loss_scale: float = 1.0,
) -> Reference:
    """Train the reference; with a 16-bit dtype the forward and backward run on a working copy in that
    dtype (gradients accumulate in it) and the optimizer steps fp32 master weights, as the engine does."""
    master = ReferenceModel(layers_of(kind, depth))
    working = copy.deepcopy(master).to(dtype) if dtype != torch.float32 else master
    pairs = list(zip(master.parameters(), working.parameters(), strict=True))
    loss_fn = token_loss if kind == "gpt" else mse
    opt = make_optimizer(optimizer, master.parameters(), lr)
    out = Reference(initial={n: p.detach().clone() for n, p in master.named_parameters()})
    for step in range(steps):
        total = 0.0
        for micro in range(micro_batches):
            x, y = global_micro_batch(kind, step, micro, rows)
            loss = loss_fn(working(x.to(dtype) if x.is_floating_point() else x), y)
            (loss * loss_scale).backward()
            total += loss.item()
        out.losses.append(total / micro_batches)
        with torch.no_grad():
            for pm, pw in pairs:
                pm.grad = pw.grad.float() / (micro_batches * loss_scale)
                if pw is not pm:
                    pw.grad = None
        norm = torch.nn.utils.clip_grad_norm_(master.parameters(), clip if clip > 0 else math.inf)
        out.norms.append(float(norm))
        opt.step()
        opt.zero_grad()
        if working is not master:
            with torch.no_grad():
                for pm, pw in pairs:
                    pw.copy_(pm)
    out.params = {n: p.detach().clone() for n, p in master.named_parameters()}
    return out
