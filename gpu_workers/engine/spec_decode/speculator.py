"""The engine's side of speculative decoding: before a step, give each eligible decoding sequence its drafts;
after the forward pass, verify them against the target's logit rows, append what was accepted, and count.

Eligibility is per request and checked every step. Requests whose sampling reads per-token state the verification
would have to replay row by row (logprobs, penalties / logit_bias, a grammar, min_tokens not yet reached)
decode one token a step as before: the same rule vLLM applies, documented in docs/architecture.md. ``min_p``
speculates: it shapes each row's distribution without reading earlier positions.

The proposer is the config's: n-gram lookup, or a draft model with its own KV cache (``draft_model.py``), which
the engine builds (it sizes the cache) and hands in. A draft model's rows of q travel with the drafts to the
rejection sampler."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from ..core.block_manager import KVBlockManager
from ..core.sequence import Sequence
from ..execution.sampler import Sampler
from .config import SpeculativeConfig
from .ngram import NgramProposer
from .rejection import verify_drafts

if TYPE_CHECKING:
    from .draft_model import DraftModelProposer


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
    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, draft_model: DraftModelProposer | None = None
    ) -> None:
        if (config.method == "draft_model") != (draft_model is not None):
            raise ValueError(f"speculative method {config.method!r} with draft model {draft_model!r}")
        self.config = config
        self.ngram = NgramProposer(config) if draft_model is None else None
        self.draft_model = draft_model
        self.max_model_len = max_model_len
        # A random request's draft distribution q per drafted sequence, for this step's verification.
        self._draft_probs: dict[Sequence, torch.Tensor] = {}
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def propose(self, running: Iterable[Sequence], sampler: Sampler) -> None:
        """Set ``spec_token_ids`` on every running sequence about to decode (empty where none or not allowed)."""
        running = list(running)
        eligible: list[Sequence] = []
        rooms: list[int] = []
        for seq in running:
            seq.spec_token_ids = []
            if seq.num_tokens - seq.num_computed_tokens != 1 or not speculation_allowed(seq):
                continue
            # Drafts past max_tokens or the context would be cut anyway: the target's own token is the last one
            # the request may take, and the last draft's position must fit the model.
            room = min(seq.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens)
            if room > 0:
                eligible.append(seq)
                rooms.append(room)
        self._draft_probs.clear()
        if self.draft_model is None:
            assert self.ngram is not None
            for seq, room in zip(eligible, rooms, strict=True):
                seq.spec_token_ids = self.ngram.propose(seq.token_ids, room)
            return
        # Sequences that left the batch (finished, aborted, preempted) give their draft-cache blocks back.
        self.draft_model.release_except(set(running))
        if not eligible:
            return
        for seq, drafts in zip(eligible, self.draft_model.propose(eligible, rooms, sampler), strict=True):
            seq.spec_token_ids = drafts.tokens
            if drafts.probs is not None:
                self._draft_probs[seq] = drafts.probs

    def forget(self, seq: Sequence) -> None:
        """A sequence finished or was aborted: drop its drafts' state (and its draft-cache blocks)."""
        self._draft_probs.pop(seq, None)
        if self.draft_model is not None:
            self.draft_model.release(seq)

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
            num_before = seq.num_tokens
            q = self._draft_probs.pop(seq, None)
            # The scheduler may have cut the tail drafts to fit its token budget: their rows of q go with them.
            verified = verify_drafts(sampler, logits[row : row + k + 1], seq, drafts, None if q is None else q[:k])
            row += k + 1
            seq.spec_token_ids = []
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += verified.num_accepted
            if self.draft_model is not None:
                self.draft_model.rollback(seq, num_before + verified.num_accepted)
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
