"""Per-token logprobs: the chosen token's and the top-k alternatives', from the raw logits' log-softmax."""

from __future__ import annotations

import torch

from ..outputs import TokenLogprob


class RawLogprobs:
    """Log-softmax of the raw logits of the rows that asked for logprobs, taken before any adjustment;
    ``resolve`` pairs them with the sampled tokens once those are known."""

    def __init__(self, logits: torch.Tensor, rows: list[int], ks: list[int]) -> None:
        self.rows = rows
        self.ks = ks
        index = torch.tensor(rows, device=logits.device)
        self.logprobs = torch.log_softmax(logits[index], dim=-1)
        max_k = max(ks)
        if max_k > 0:
            top_values, top_ids = self.logprobs.topk(max_k, dim=-1)
            self.top_values = top_values.tolist()
            self.top_ids = top_ids.tolist()
        else:
            self.top_values = self.top_ids = [[] for _ in rows]

    @classmethod
    def capture(cls, logits: torch.Tensor, ks: list[int | None]) -> RawLogprobs | None:
        """The raw logprobs of rows whose ``k`` is not None; None when no row asks."""
        rows = [i for i, k in enumerate(ks) if k is not None]
        if not rows:
            return None
        return cls(logits, rows, [ks[i] or 0 for i in rows])

    def resolve(self, tokens: list[int], num_rows: int) -> list[TokenLogprob | None]:
        """One ``TokenLogprob`` per row (None for rows that did not ask), for the sampled ``tokens``."""
        out: list[TokenLogprob | None] = [None] * num_rows
        chosen_ids = torch.tensor([tokens[i] for i in self.rows], device=self.logprobs.device)
        chosen = self.logprobs.gather(1, chosen_ids[:, None])[:, 0].tolist()
        for j, (i, k) in enumerate(zip(self.rows, self.ks, strict=True)):
            top = list(zip(self.top_ids[j][:k], self.top_values[j][:k], strict=True))
            out[i] = TokenLogprob(token_id=tokens[i], logprob=chosen[j], top=top)
        return out
