"""Verification of draft tokens against the target model's logits, computed in one forward pass over
``[last token, d_1 .. d_k]`` (row j predicts the token after d_j; row 0 the token after the last one).

Greedy rows accept drafts while they equal the row's argmax, then append the argmax of the first row that
disagreed (or of the last row, the bonus token), so the output is the non-speculative greedy output token for
token. Random rows use rejection sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"): a draft proposed with probability q(d) is kept with probability min(1, p(d) / q(d));
at the first rejection the replacement is drawn from normalise(max(p - q, 0)); after k acceptances a bonus token
is drawn from the last row. A draft model passes its rows of q; the n-gram proposer is deterministic (q is a
point mass on d), so there the test is ``u < p(d)`` and the residual is p with d removed. Either way each
emitted token is distributed exactly as the target's sampler (temperature, min_p, top-k/top-p applied) would
draw it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.sequence import Sequence
from ..execution.sampler import Sampler


@dataclass
class Verified:
    """The tokens to append (accepted drafts then one target token) and how many drafts were accepted."""

    tokens: list[int]
    num_accepted: int


def verify_drafts(
    sampler: Sampler, logits: torch.Tensor, seq: Sequence, drafts: list[int], draft_probs: torch.Tensor | None = None
) -> Verified:
    """``logits``: float32 ``[len(drafts) + 1, vocab]``, the target's rows for this sequence; ``draft_probs``:
    ``[len(drafts), vocab]``, the distribution each draft was drawn from (None: each draft was certain)."""
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise ValueError(f"expected {k + 1} logit rows for {k} drafts, got {logits.shape[0]}")
    if seq.params.greedy:
        best = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == best[accepted]:
            accepted += 1
        return Verified([*drafts[:accepted], best[accepted]], accepted)
    probs = sampler.target_probs(logits, [seq] * (k + 1))
    draft_ids = torch.tensor(drafts, dtype=torch.int64, device=probs.device)
    rows = torch.arange(k, device=probs.device)
    p_draft = probs[rows, draft_ids]
    if draft_probs is None:
        rejected = (sampler.uniform(k, seq) >= p_draft).nonzero()
    else:
        if draft_probs.shape != (k, probs.shape[1]):
            raise ValueError(
                f"expected draft probabilities of shape {(k, probs.shape[1])}, got {tuple(draft_probs.shape)}"
            )
        # Keep d with probability min(1, p(d) / q(d)), written without the division (q(d) > 0: d was drawn).
        q = draft_probs.to(probs.device, probs.dtype)
        rejected = (sampler.uniform(k, seq) * q[rows, draft_ids] >= p_draft).nonzero()
    accepted = int(rejected[0, 0]) if rejected.numel() else k
    final = probs[accepted]
    if accepted < k:
        if draft_probs is None:
            # Residual max(p - q, 0) with q a point mass on the draft: p without the rejected token.
            final = final.clone()
            final[drafts[accepted]] = 0.0
        else:
            residual = (final - q[accepted]).clamp_min_(0.0)
            # p <= q everywhere only when p == q (both sum to 1), and then a rejection has probability 0;
            # float rounding can still get here, and p is then the right distribution.
            final = residual if float(residual.sum()) > 0.0 else final
    # The token takes the position after the accepted drafts (its seeded draw is keyed there).
    token = int(sampler.draw(final[None, :], [seq], [accepted])[0])
    return Verified([*drafts[:accepted], token], accepted)
