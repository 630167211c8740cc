"""The n-gram (prompt lookup) proposer: drafts the tokens that followed the most recent earlier occurrence (with k
tokens after it) of the sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``), in
prompt + output.

No model runs: drafting is a vectorised window compare over the token list (numpy), one per candidate n, so it
costs microseconds per sequence next to a forward pass. It pays off when the output repeats its input (edits,
summaries quoting the source, code rewrites)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to ``min(k, max_tokens)`` draft tokens continuing ``token_ids``; empty when no n-gram recurs."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        length = len(token_ids)
        if k <= 0 or length < self.min_n + 1:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            pattern = arr[length - n :]
            # Windows that end before the last token, so each match has at least one token after it.
            windows = sliding_window_view(arr[: length - 1], n)
            matches = np.flatnonzero((windows == pattern).all(axis=1))
            if matches.size:
                # The latest match with k tokens after it; a loop in the output otherwise makes the latest match
                # the one just before the end, whose continuation is a single token. Else the earliest (longest).
                full = matches[matches + n + k <= length]
                start = int(full[-1] if full.size else matches[0]) + n
                return token_ids[start : start + k]
        return []
