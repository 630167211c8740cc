"""Folding a request's stream events into the text (and logprobs) a client should see, once and in order,
per choice.

Redis may hand an event over twice (a retried read, a worker re-appending after a crash), so events are
de-duplicated by ``seq``. A ``restart`` drops the text after ``discard_after_seq``; for a client that was
already sent that text, the regenerated text is relayed only past what it has, and a regeneration that
contradicts what was sent is flagged (``diverged``) because sent text cannot be taken back. With ``n`` > 1
events carry their choice's ``index`` and each choice's last event its ``finish_reason``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas import DoneEvent, ErrorEvent, RestartEvent, StreamEvent, TokenEvent
from schemas.events import FinishReason
from schemas.generation import TokenLogprob


@dataclass
class _Piece:
    seq: int
    text: str
    tokens: int
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None


@dataclass
class ChoiceDelta:
    """What to relay for one choice now: new text, the logprobs of its new tokens, and its end if it ended."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None


@dataclass
class _Choice:
    pieces: list[_Piece] = field(default_factory=list)
    sent: str = ""
    sent_logprobs: int = 0
    ended: bool = False

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)

    def logprobs(self) -> list[TokenLogprob]:
        return [lp for p in self.pieces for lp in p.logprobs or []]

    def finish_reason(self) -> FinishReason | None:
        return next((p.finish_reason for p in self.pieces if p.finish_reason is not None), None)


@dataclass
class StreamAssembler:
    """Feed events in stream order; read ``text``, ``done``, ``error`` and ``diverged`` (choice 0), or
    :meth:`choice_text` and friends for the others."""

    done: DoneEvent | None = None
    error: ErrorEvent | None = None
    diverged: bool = False
    _last_seq: int = -1
    _choices: dict[int, _Choice] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        """A terminal event (``done`` or ``error``) arrived."""
        return self.done is not None or self.error is not None

    @property
    def text(self) -> str:
        """All text of choice 0 currently standing (after any restarts)."""
        return self.choice_text(0)

    @property
    def completion_tokens(self) -> int:
        """Token ids behind every choice's text."""
        return sum(p.tokens for c in self._choices.values() for p in c.pieces)

    @property
    def indices(self) -> list[int]:
        """The choices seen so far, in order."""
        return sorted(self._choices)

    def choice_text(self, index: int) -> str:
        choice = self._choices.get(index)
        return choice.text if choice else ""

    def choice_logprobs(self, index: int) -> list[TokenLogprob]:
        choice = self._choices.get(index)
        return choice.logprobs() if choice else []

    def finish_reason(self, index: int) -> FinishReason:
        """A choice's own end, else the request's."""
        choice = self._choices.get(index)
        own = choice.finish_reason() if choice else None
        if own is not None:
            return own
        return self.done.finish_reason if self.done is not None else "abort"

    def feed(self, event: StreamEvent) -> str:
        """Apply one event; returns choice 0's text to relay now (often empty)."""
        return "".join(d.text for d in self.feed_choices(event) if d.index == 0)

    def feed_choices(self, event: StreamEvent) -> list[ChoiceDelta]:
        """Apply one event; returns what to relay now per choice (text, logprobs, a choice's end)."""
        if event.seq <= self._last_seq or self.finished:
            return []
        self._last_seq = event.seq
        if isinstance(event, TokenEvent):
            choice = self._choices.setdefault(event.index, _Choice())
            choice.pieces.append(
                _Piece(event.seq, event.text, len(event.token_ids), event.logprobs, event.finish_reason)
            )
            return self._advance([event.index])
        if isinstance(event, RestartEvent):
            for choice in self._choices.values():
                choice.pieces = [p for p in choice.pieces if p.seq <= event.discard_after_seq]
            return self._advance(self.indices)
        if isinstance(event, DoneEvent):
            self.done = event
        elif isinstance(event, ErrorEvent):
            self.error = event
        return []

    def _advance(self, indices: list[int]) -> list[ChoiceDelta]:
        if self.diverged:
            return []
        out = []
        for index in indices:
            choice = self._choices[index]
            delta = ChoiceDelta(index)
            text = choice.text
            if text.startswith(choice.sent):
                delta.text = text[len(choice.sent) :]
                choice.sent = text
                logprobs = choice.logprobs()
                delta.logprobs = logprobs[choice.sent_logprobs :]
                choice.sent_logprobs = max(choice.sent_logprobs, len(logprobs))
            elif not choice.sent.startswith(text):
                self.diverged = True
                return []
            # Otherwise a restart rolled back text the client has; wait until the regeneration passes it.
            reason = choice.finish_reason()
            if reason is not None and not choice.ended and text.startswith(choice.sent):
                choice.ended = True
                delta.finish_reason = reason
            if delta.text or delta.logprobs or delta.finish_reason:
                out.append(delta)
        return out

    def ended(self, index: int) -> bool:
        """Whether a choice's end was already relayed."""
        choice = self._choices.get(index)
        return bool(choice and choice.ended)
