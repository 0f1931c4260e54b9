"""Tiny deterministic models, data and a plain-PyTorch reference trainer for the engine tests.

`UnevenNet` has parameters of awkward sizes (13x24, 31, 5, ...), so flat buffers need padding at every
world size, and `param_groups` splits it into two groups with different weight decay. Data is a fixed
global batch per (step, micro-step); rank r of W takes rows [r*G/W, (r+1)*G/W), so the same global batch
reaches the model whatever the world size. `reference_train` is what the engine must equal: one process,
the whole global batch, fp32 master weights and a working copy in the run's dtype, gradients accumulated
in that dtype, averaged, unscaled, clipped with torch.nn.utils.clip_grad_norm_, and a torch optimizer.
`with_offload_settings` loads a config with internal offload settings (chunk sizes, ...) that no config
key reaches, so a tiny model still spans several chunks.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IN_FEATURES = 13
CLASSES = 5


class UnevenNet(nn.Module):
    def __init__(self, hidden: int = 24, width: int = 31) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, hidden)
        self.hidden = nn.Linear(hidden, width)
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(F.gelu(self.hidden(F.gelu(self.inp(x))))))


def make_model(seed: int = 0, **sizes: int) -> UnevenNet:
    torch.manual_seed(seed)
    return UnevenNet(**sizes)


def param_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict[str, Any]]:
    """Matrices decay, biases and norm weights do not (the usual GPT split)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def with_offload_settings(config: Mapping[str, Any], *, world_size: int, **settings: Any) -> Any:
    """`config` loaded for `world_size` (a `runtime.config.Config` for runtime.initialize), with `settings`
    replacing fields of its `zero_optimization.offload_optimizer` (`runtime.offload.settings`)."""
    from runtime.config import load_config

    loaded = load_config(config, world_size=world_size)
    zero = loaded.zero_optimization
    offload = replace(zero.offload_optimizer, **settings)
    return replace(loaded, zero_optimization=replace(zero, offload_optimizer=offload))


def global_batch(step: int, micro: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + 97 * step + micro)
    x = torch.randn(rows, IN_FEATURES, generator=gen)
    y = torch.randint(0, CLASSES, (rows,), generator=gen)
    return x, y


def rank_batch(
    step: int, micro: int, rows: int, rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, micro, rows)
    per = rows // world_size
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), y)


def train_engine(
    engine: Any, *, steps: int, accumulation: int, rows: int, rank: int, world_size: int
) -> tuple[list[float], list[float | None]]:
    """Train `engine` on this rank's part of the global batches; returns the per-micro-step losses averaged
    over ranks (the global batch mean, comparable with the reference) and the per-step grad norms."""
    import torch.distributed as dist

    losses, norms = [], []
    for step in range(steps):
        for micro in range(accumulation):
            x, y = rank_batch(step, micro, rows, rank, world_size)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        norms.append(engine.get_global_grad_norm())
    mean_losses = torch.stack(losses)
    dist.all_reduce(mean_losses)
    mean_losses /= world_size
    return mean_losses.tolist(), norms


@dataclass
class RefResult:
    losses: list[float] = field(default_factory=list)  # one per micro-step (global batch mean)
    norms: list[float] = field(default_factory=list)  # per step, unscaled, before clipping
    master: dict[str, torch.Tensor] = field(default_factory=dict)  # fp32 after training
    working: dict[str, torch.Tensor] = field(default_factory=dict)  # param_dtype after training
    initial: dict[str, torch.Tensor] = field(default_factory=dict)  # fp32 before training
    model: nn.Module | None = None  # the fp32 master model after training


def build_optimizer(kind: str, groups: list[dict[str, Any]], lr: float) -> torch.optim.Optimizer:
    if kind == "AdamW":
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    if kind == "SGD":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    raise ValueError(kind)


def reference_train(
    *,
    steps: int,
    accumulation: int,
    rows: int,
    param_dtype: torch.dtype,
    optimizer: str,
    lr: float,
    clip: float,
    loss_scale: float = 1.0,
    seed: int = 0,
    model: Callable[[int], nn.Module] | None = None,
) -> RefResult:
    """`model(seed)` (default `make_model`) trained as the engine must match (see the module docstring)."""
    master = (make_model if model is None else model)(seed)
    result = RefResult(initial={n: p.detach().clone() for n, p in master.named_parameters()})
    working = copy.deepcopy(master).to(param_dtype)
    opt = build_optimizer(optimizer, param_groups(master), lr)
    pairs = list(zip(master.parameters(), working.parameters(), strict=True))
    for step in range(steps):
        for micro in range(accumulation):
            x, y = global_batch(step, micro, rows)
            loss = loss_fn(working(x.to(param_dtype)), y)
            (loss * loss_scale).backward()
            result.losses.append(loss.item())
        with torch.no_grad():
            for pm, pw in pairs:
                pm.grad = pw.grad.float() / (accumulation * loss_scale)
                pw.grad = None
        norm = torch.nn.utils.clip_grad_norm_(master.parameters(), clip if clip > 0 else math.inf)
        result.norms.append(float(norm))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for pm, pw in pairs:
                pw.copy_(pm)
    result.master = {n: p.detach().clone() for n, p in master.named_parameters()}
    result.working = {n: p.detach().clone() for n, p in working.named_parameters()}
    result.model = master
    return result
