"""The engine's side of speculative decoding: before a step, give each eligible decoding sequence its drafts;
after the forward pass, verify them against the target's logit rows, append what was accepted, and count.

Eligibility is per request and checked every step. Requests whose sampling reads per-token state the verification
would have to replay row by row (logprobs, penalties / logit_bias, a grammar, min_tokens not yet reached)
decode one token a step as before: the same rule vLLM applies, documented in docs/architecture.md."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..core.block_manager import KVBlockManager
from ..core.sequence import Sequence
from ..execution.sampler import Sampler
from .config import SpeculativeConfig
from .ngram import NgramProposer
from .rejection import verify_drafts


def speculation_allowed(seq: Sequence) -> bool:
    """Whether a sequence may verify drafts this step (see the module docstring)."""
    params = seq.params
    return (
        params.logprobs is None
        and not params.has_penalties
        and seq.guided is None
        and seq.num_output_tokens >= params.min_tokens
    )


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.proposer = NgramProposer(config)
        self.max_model_len = max_model_len
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def propose(self, running: Iterable[Sequence]) -> None:
        """Set ``spec_token_ids`` on every running sequence about to decode (empty where none or not allowed)."""
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens != 1 or not speculation_allowed(seq):
                seq.spec_token_ids = []
                continue
            # Drafts past max_tokens or the context would be cut anyway: the target's own token is the last one
            # the request may take, and the last draft's position must fit the model.
            room = min(seq.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens)
            seq.spec_token_ids = self.proposer.propose(seq.token_ids, room) if room > 0 else []

    def accept(
        self,
        sampler: Sampler,
        seqs: list[Sequence],
        logits: torch.Tensor,
        append_token: Callable[[Sequence, int], None],
        block_manager: KVBlockManager,
    ) -> tuple[list[Sequence], torch.Tensor, list[Sequence]]:
        """Verify and append the drafts of every sequence in ``seqs`` that had some. Returns the other sequences
        with their logit rows (for the plain sampler) and the sequences served here (for their deltas)."""
        plain: list[Sequence] = []
        plain_rows: list[int] = []
        served: list[Sequence] = []
        row = 0
        for seq in seqs:
            drafts = seq.spec_token_ids
            if not drafts:
                plain.append(seq)
                plain_rows.append(row)
                row += 1
                continue
            k = len(drafts)
            verified = verify_drafts(sampler, logits[row : row + k + 1], seq, drafts)
            row += k + 1
            seq.spec_token_ids = []
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += verified.num_accepted
            for token in verified.tokens:
                append_token(seq, token)
                if seq.is_finished:
                    break  # a stop rule cut the draft: the rest is dropped
            else:
                # The accepted drafts' K/V was written by the verification pass; the target's token is new.
                seq.num_computed_tokens += verified.num_accepted
                block_manager.cache_computed_blocks(seq)
            served.append(seq)
        if row != logits.shape[0]:
            raise RuntimeError(f"logit rows ({logits.shape[0]}) do not match the batch's drafts ({row})")
        index = torch.tensor(plain_rows, dtype=torch.int64, device=logits.device)
        return plain, logits[index], served
