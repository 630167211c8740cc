"""The layers that talk across ranks. Column-parallel projections (merged Q/K/V, gate/up) need none: each rank's
``nn.Linear`` simply has its rows, and their output stays split by head / by intermediate column. What does:

- ``RowParallelLinear`` (O and down projections): each rank multiplies its input columns, one all-reduce sums
  the partial products, then the (unsplit) bias is added once;
- ``VocabParallelEmbedding``: each rank looks up the ids in its vocabulary range, zeros elsewhere, all-reduce;
- ``ParallelLMHead``: each rank computes the logits of its vocabulary range; an all-gather puts the row
  together (the padding past the real vocabulary is cut off).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .group import TPGroup


class RowParallelLinear(nn.Module):
    def __init__(self, in_local: int, out_features: int, bias: bool, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(F.linear(x, self.weight))
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_start: int, vocab_local: int, hidden: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_local, hidden))
        self.vocab_start = vocab_start
        self.vocab_local = vocab_local
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(out.masked_fill(outside[:, None], 0.0))


class ParallelLMHead(nn.Module):
    def __init__(self, vocab_local: int, hidden: int, vocab_size: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_local, hidden))
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(F.linear(hidden, self.weight))[..., : self.vocab_size]
