"""Models for the ZeRO-3 tests: tied weights, a module called twice, a parameter used outside its module.

`ZeroNet` takes the same inputs and classes as tests/support/models.py's `UnevenNet` (13 features -> 5
classes), so the same batches and loss apply. Its parts exercise what ZeRO-3 must get right:

- `emb` (13x24) is used as a soft embedding `x @ emb.weight` in the model's own forward (outside
  `emb`'s forward; `emb` is never called), and is tied to `head` (an nn.Linear 24->13 whose weight *is*
  `emb.weight`), like GPT's embedding and output head;
- `shared` is called twice in one forward;
- `blocks` is a ModuleList (each block is a gather unit) of MLPs with uneven sizes (24 -> 37 -> 24);
- `norm` is small (48 elements), so with a persistence threshold above that it stays gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.support.models import CLASSES, IN_FEATURES

DIM, HIDDEN = 24, 37


class MLPBlock(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class ZeroNet(nn.Module):
    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(IN_FEATURES, DIM)
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(depth))
        self.shared = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, IN_FEATURES, bias=False)
        self.head.weight = self.emb.weight  # tied, as GPT ties its output head to the embedding
        self.out = nn.Linear(IN_FEATURES, CLASSES)

    def forward(self, x: torch.Tensor, skip_shared: bool = False) -> torch.Tensor:
        h = x @ self.emb.weight  # the embedding's weight, outside any forward of `emb`
        for block in self.blocks:
            h = block(h)
        if not skip_shared:  # another path through the model, for trace invalidation
            h = self.shared(F.gelu(self.shared(h)))  # one module, called twice
        return self.out(F.gelu(self.head(self.norm(h))))


def make_zero_net(seed: int = 0, depth: int = 2) -> ZeroNet:
    torch.manual_seed(seed)
    return ZeroNet(depth)
