"""One guided request's grammar state, and the batch's allowed-token mask built from every guided row."""

from __future__ import annotations

import torch
import xgrammar as xgr

from .params import GuidedDecoding


class GuidedState:
    """A request's grammar matcher: replays delivered tokens, fills its row of the mask, accepts tokens."""

    def __init__(self, compiled: xgr.CompiledGrammar, guided: GuidedDecoding) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        for i, token in enumerate(guided.replay_token_ids):
            if not self.matcher.accept_token(token):
                raise ValueError(
                    f"replay_token_ids[{i}] = {token} does not continue the grammar: the delivered tokens "
                    "cannot have come from this constraint"
                )

    def fork(self) -> GuidedState:
        """An independent copy at the same point (a sibling choice of an ``n > 1`` request)."""
        twin = object.__new__(GuidedState)
        twin.matcher = self.matcher.fork()
        return twin

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar refuses it (nothing was allowed)."""
        return self.matcher.accept_token(token)

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

    def apply(self, logits: torch.Tensor) -> None:
        bitmask = self.bitmask if logits.device.type == "cpu" else self.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=self.rows)


def grammar_bitmask(states: list[GuidedState | None], vocab_size: int) -> TokenBitmask | None:
    """The batch's ``TokenBitmask``; None when no row has a grammar."""
    if all(s is None for s in states):
        return None
    return TokenBitmask(states, vocab_size)
