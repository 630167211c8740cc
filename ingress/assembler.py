"""Folding a request's stream events into the text a client should see, once and in order.

Redis may hand an event over twice (a retried read, a worker re-appending after a crash), so events are
de-duplicated by ``seq``. A ``restart`` drops the text after ``discard_after_seq``; for a client that was
already sent that text, the regenerated text is relayed only past what it has, and a regeneration that
contradicts what was sent is flagged (``diverged``) because sent text cannot be taken back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas import DoneEvent, ErrorEvent, RestartEvent, StreamEvent, TokenEvent


@dataclass
class _Piece:
    seq: int
    text: str
    tokens: int


@dataclass
class StreamAssembler:
    """Feed events in stream order; read ``text``, ``done``, ``error`` and ``diverged``."""

    done: DoneEvent | None = None
    error: ErrorEvent | None = None
    diverged: bool = False
    _last_seq: int = -1
    _pieces: list[_Piece] = field(default_factory=list)
    _sent: str = ""

    @property
    def finished(self) -> bool:
        """A terminal event (``done`` or ``error``) arrived."""
        return self.done is not None or self.error is not None

    @property
    def text(self) -> str:
        """All text currently standing (after any restarts)."""
        return "".join(p.text for p in self._pieces)

    @property
    def completion_tokens(self) -> int:
        """Token ids behind ``text``."""
        return sum(p.tokens for p in self._pieces)

    def feed(self, event: StreamEvent) -> str:
        """Apply one event; returns the text to relay now (often empty)."""
        if event.seq <= self._last_seq or self.finished:
            return ""
        self._last_seq = event.seq
        if isinstance(event, TokenEvent):
            self._pieces.append(_Piece(event.seq, event.text, len(event.token_ids)))
        elif isinstance(event, RestartEvent):
            self._pieces = [p for p in self._pieces if p.seq <= event.discard_after_seq]
        elif isinstance(event, DoneEvent):
            self.done = event
        elif isinstance(event, ErrorEvent):
            self.error = event
        return self._advance()

    def _advance(self) -> str:
        if self.diverged:
            return ""
        text = self.text
        if text.startswith(self._sent):
            delta = text[len(self._sent) :]
            self._sent = text
            return delta
        if not self._sent.startswith(text):
            self.diverged = True
        # Otherwise a restart rolled back text the client has; wait until the regeneration passes it.
        return ""
