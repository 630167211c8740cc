"""Following the choices of one request (``n`` > 1) and its logprobs: each engine delta becomes one stream
event naming its choice, a choice's last event carries its ``finish_reason``, and at the end every choice is
known for the final result. One-choice requests without logprobs never build one of these."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_workers.engine import RequestDelta
from schemas import ChoiceResult, TokenEvent, TokenLogprob
from schemas.events import FinishReason

from .prompts import LogprobText


@dataclass
class _Choice:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None


class ChoiceTracker:
    """The per-choice state of one request's stream."""

    def __init__(self, n: int, logprob_text: LogprobText) -> None:
        self.n = n
        self._text = logprob_text
        self._choices = [_Choice() for _ in range(n)]

    def event(self, request_id: str, seq: int, delta: RequestDelta) -> TokenEvent | None:
        """The stream event for one of the engine's deltas with ``n`` > 1 (None when it adds nothing)."""
        return self.choice_event(
            request_id, seq, delta.index, delta.token_ids, delta.text, delta.logprobs, delta.finish_reason
        )

    def choice_event(
        self,
        request_id: str,
        seq: int,
        index: int,
        token_ids: list[int],
        text: str,
        logprobs: object,
        finish_reason: str | None,
    ) -> TokenEvent | None:
        """Record a choice's new tokens and text (and its end): the stream event for them, or None."""
        choice = self._choices[index]
        converted = self.add(index, token_ids, text, logprobs)
        if finish_reason is not None:
            choice.finish_reason = _reason(finish_reason)
        if not (text or token_ids or finish_reason):
            return None
        return TokenEvent(
            request_id=request_id,
            seq=seq,
            text=text,
            token_ids=list(token_ids),
            index=index,
            logprobs=converted,
            finish_reason=choice.finish_reason,
        )

    def restore(self, index: int, token_ids: list[int], text: str, finish_reason: FinishReason | None) -> None:
        """A choice as a resumed request's stream already holds it (its logprobs are not kept there)."""
        self._choices[index] = _Choice(list(token_ids), text, [], finish_reason)

    def add(self, index: int, token_ids: list[int], text: str, logprobs: object) -> list[TokenLogprob] | None:
        """Record a choice's new tokens; returns their logprobs in the contract's shape."""
        choice = self._choices[index]
        choice.token_ids.extend(token_ids)
        choice.text += text
        converted = self._text.convert(logprobs)  # type: ignore[arg-type]
        if converted:
            choice.logprobs.extend(converted)
        return converted

    @property
    def all_ended(self) -> bool:
        return all(c.finish_reason is not None for c in self._choices)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self._choices)

    def first(self) -> tuple[list[int], str]:
        """Choice 0's tokens and text (the final result's top-level fields)."""
        return list(self._choices[0].token_ids), self._choices[0].text

    def results(self, fallback: FinishReason, keep_logprobs: bool) -> list[ChoiceResult]:
        """Every choice, for the final result."""
        return [
            ChoiceResult(
                index=i,
                text=c.text,
                token_ids=list(c.token_ids),
                finish_reason=c.finish_reason or fallback,
                logprobs=list(c.logprobs) if keep_logprobs else None,
            )
            for i, c in enumerate(self._choices)
        ]

    def finish_reason(self) -> FinishReason:
        """The request's: choice 0's."""
        return self._choices[0].finish_reason or "stop"


def _reason(value: str) -> FinishReason:
    return value if value in ("stop", "length", "abort", "error") else "stop"  # type: ignore[return-value]
