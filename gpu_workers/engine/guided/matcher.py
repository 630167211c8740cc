"""One guided request's grammar state, and the batch's allowed-token mask built from every guided row."""

from __future__ import annotations

import torch
import xgrammar as xgr

from .params import GuidedDecoding

_BITS = torch.arange(32, dtype=torch.int32)


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


def allowed_token_mask(states: list[GuidedState | None], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """``[len(states), vocab_size]`` bool, True where the row's grammar allows the token (every token on
    rows without a grammar); None when no row has one. One bitmask for the batch, unpacked in one go."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return None
    bitmask = xgr.allocate_token_bitmask(len(states), vocab_size)  # all bits set: everything allowed
    for i in rows:
        state = states[i]
        assert state is not None
        state.matcher.fill_next_token_bitmask(bitmask, i)
    bits = (bitmask[:, :, None] >> _BITS) & 1
    return bits.reshape(len(states), -1)[:, :vocab_size].bool().to(device)
