"""Pooling for embedding requests: the final normed hidden states of a prompt -> one L2-normalized vector.

An embedding request is a prefill-only sequence. Each step the model runner hands this module the rows of
the step's hidden states that belong to such a sequence (one prefill chunk of it); ``last`` pooling keeps the
final prompt token's row (vLLM's default for decoder models), ``mean`` sums every row in float32 across
chunks. Once the prompt's last chunk is computed the vector is normalized and set on ``seq.embedding``; the
engine then finishes the sequence. A chunk that starts at position 0 starts the sum afresh (a preempted
sequence recomputes its prompt from the start: it never reads the prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.sequence import Sequence


@dataclass(frozen=True)
class PoolSpan:
    """Rows ``[start, end)`` of a step's hidden states: prompt positions ``[first_pos, first_pos + end - start)``."""

    seq: Sequence
    start: int
    end: int
    first_pos: int


def pool(hidden: torch.Tensor, spans: list[PoolSpan]) -> None:
    """Fold each span's rows into its sequence; set ``seq.embedding`` where the span ends the prompt."""
    for span in spans:
        seq = span.seq
        final = span.first_pos + span.end - span.start == seq.num_tokens
        if seq.pooling == "mean":
            part = hidden[span.start : span.end].float().sum(dim=0)
            seq.pool_sum = part if span.first_pos == 0 or seq.pool_sum is None else seq.pool_sum + part
        if not final:
            continue
        vector = seq.pool_sum / seq.num_tokens if seq.pool_sum is not None else hidden[span.end - 1].float()
        seq.embedding = F.normalize(vector, dim=0).cpu().tolist()
        seq.pool_sum = None
