"""One guided request's grammar state (with its place in the output's UTF-8, ``utf8_mask``), and the batch's
allowed-token mask built from every guided row."""

from __future__ import annotations

import torch
import xgrammar as xgr

from .params import GuidedDecoding
from .utf8_mask import ACCEPT, Utf8Cursor, Utf8Table


class GuidedState:
    """A request's grammar matcher and UTF-8 cursor: replays delivered tokens, fills its row of the mask,
    accepts tokens."""

    def __init__(self, compiled: xgr.CompiledGrammar, guided: GuidedDecoding, utf8: Utf8Table) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.utf8 = Utf8Cursor(utf8)
        for i, token in enumerate(guided.replay_token_ids):
            if not self.matcher.accept_token(token):
                raise ValueError(
                    f"replay_token_ids[{i}] = {token} does not continue the grammar: the delivered tokens "
                    "cannot have come from this constraint"
                )
            if not self.utf8.accept(token):
                # Delivered before this check existed: the bad bytes are out already; go on from a boundary.
                self.utf8.state = ACCEPT

    def fork(self) -> GuidedState:
        """An independent copy at the same point (a sibling choice of an ``n > 1`` request)."""
        twin = object.__new__(GuidedState)
        twin.matcher = self.matcher.fork()
        twin.utf8 = self.utf8.fork()
        return twin

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar or UTF-8 refuses it (nothing was allowed)."""
        return self.matcher.accept_token(token) and self.utf8.accept(token)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the output is done."""
        return self.matcher.is_terminated()


class TokenBitmask:
    """The batch's allowed tokens as xgrammar's packed bitmask (one bit per token, rows without a grammar
    untouched); ``apply`` sets every disallowed logit to -inf in place with xgrammar's kernel, which is an
    order of magnitude cheaper on CPU than unpacking the bits into a boolean mask."""

    def __init__(self, states: list[GuidedState | None], vocab_size: int) -> None:
        self.rows = [i for i, s in enumerate(states) if s is not None]
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(len(states), vocab_size)
        for i in self.rows:
            state = states[i]
            assert state is not None
            state.matcher.fill_next_token_bitmask(self.bitmask, i)
            state.utf8.restrict(self.bitmask, i)

    def apply(self, logits: torch.Tensor) -> None:
        bitmask = self.bitmask if logits.device.type == "cpu" else self.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=self.rows)


def grammar_bitmask(states: list[GuidedState | None], vocab_size: int) -> TokenBitmask | None:
    """The batch's ``TokenBitmask``; None when no row has a grammar."""
    if all(s is None for s in states):
        return None
    return TokenBitmask(states, vocab_size)
