"""Continuing a request from the tokens its stream already delivered, with text that joins seamlessly.

A re-delivered request runs again with prompt + delivered tokens as its prompt. The engine decodes the
new tokens with only a few tokens of context, which is not what the client would have seen from an
uninterrupted run: text the first run held back (an unfinished multi-byte character, a tail that might
still grow into a stop string) would be lost, and a stop string straddling the resume point would go
unnoticed. So the worker replays the delivered tokens through its own incremental detokenizer, seeded
exactly like the first run's, and emits the text of the new tokens relative to what was delivered.
"""

from __future__ import annotations

from typing import Any

from gpu_workers.engine import IncrementalDetokenizer
from schemas import InferenceRequest
from schemas.events import FinishReason


class Continuation:
    """The text state of a resumed request: what the first run decoded, and what is still owed.

    ``text`` follows the engine's rules for an uninterrupted run (stop strings cut it, the held-back
    tail is released at the end); :meth:`take` returns the part not yet sent to the client.
    """

    def __init__(
        self,
        request: InferenceRequest,
        tokenizer: Any,
        prompt: list[int],
        delivered_ids: list[int],
        delivered_text: str,
        eos_ids: frozenset[int],
    ) -> None:
        opts = request.sampling
        self.stops = list(opts.stop)
        self.max_stop_len = max((len(s) for s in self.stops), default=0)
        self.stop_token_ids = frozenset(opts.stop_token_ids)
        self.eos_ids = frozenset() if opts.ignore_eos else eos_ids
        self.max_tokens = opts.max_tokens
        self.token_ids = list(delivered_ids)
        self._detok = IncrementalDetokenizer(tokenizer, prompt, True, frozenset(tokenizer.all_special_ids))
        self.text = "".join(self._detok.step(t) for t in delivered_ids)
        # True when the delivered text is what this tokenizer makes of the delivered tokens; when it is
        # not (another model or tokenizer answered first), the request cannot be continued seamlessly.
        self.consistent = self.text.startswith(delivered_text)
        self.sent = len(delivered_text)
        self.cut = False  # the text ends at a stop string (nothing more is released at the end)

    def finished_already(self) -> FinishReason | None:
        """Whether the delivered tokens already end the request (the first run died before ``done``)."""
        last = self.token_ids[-1] if self.token_ids else None
        if last is not None and (last in self.eos_ids or last in self.stop_token_ids):
            return "stop"
        if self._cut_at_stop(0):
            return "stop"
        if len(self.token_ids) >= self.max_tokens:
            return "length"
        return None

    def feed(self, token_ids: list[int]) -> bool:
        """Add new tokens; True when a stop string now ends the text (the engine did not see it)."""
        for token in token_ids:
            self.token_ids.append(token)
            if self.cut:
                continue
            piece = self._detok.step(token)
            if not piece:
                continue
            self.text += piece
            if self._cut_at_stop(max(0, len(self.text) - len(piece) - self.max_stop_len + 1)):
                return True
        return False

    def close(self, reason: FinishReason) -> None:
        """The request ended: release held-back text unless a stop string cut it (or it was aborted)."""
        if not self.cut and reason in ("stop", "length"):
            self.text += self._detok.flush()

    def take(self, final: bool) -> str:
        """Text the client has not received yet; while running, a possible stop-string prefix is held."""
        held = 0 if final or not self.stops else self.max_stop_len - 1
        upto = max(self.sent, len(self.text) - held)
        out = self.text[self.sent : upto]
        self.sent = upto
        return out

    def _cut_at_stop(self, search_from: int) -> bool:
        if self.cut or not self.stops:
            return self.cut
        best: int | None = None
        for stop in self.stops:
            idx = self.text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best):
                best = idx
        if best is None:
            return False
        self.text = self.text[:best]
        self.sent = min(self.sent, best)
        self.cut = True
        return True
