"""OpenAI response objects built from Sluicegate results: ``chat.completion(.chunk)``, ``text_completion``,
usage, and server-sent-event framing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from schemas import Usage

Kind = Literal["chat", "completion"]

#: HTTP status for a worker error code when the response has not started yet.
ERROR_STATUS: dict[str, int] = {
    "deadline_exceeded": 504,
    "timeout": 504,
    "cancelled": 409,
    "invalid_request": 400,
    "prompt_too_long": 400,
    "context_length_exceeded": 400,
    "model_not_found": 404,
    "overloaded": 503,
}

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as compact JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def openai_usage(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage object, with cached prompt tokens in ``prompt_tokens_details``."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass(frozen=True)
class ResponseIds:
    """What every object of one response shares."""

    kind: Kind
    request_id: str
    model: str
    created: int

    @property
    def id(self) -> str:
        """``chatcmpl-<request id>`` or ``cmpl-<request id>``, as OpenAI prefixes them."""
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{self.request_id}"

    def _base(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    # --- streaming ------------------------------------------------------------------------------
    def chunk(
        self,
        *,
        text: str | None = None,
        role: bool = False,
        finish_reason: str | None = None,
        include_usage: bool = False,
    ) -> dict[str, Any]:
        """One choice chunk: the first (``role``), a text delta, or the last (``finish_reason``).

        With ``include_usage`` every chunk carries ``usage: null``, as OpenAI sends it, and only the
        final :meth:`usage_chunk` has numbers.
        """
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif text is not None:
                delta = {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._base("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            body = self._base("text_completion")
        body["choices"] = [choice]
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The closing chunk of ``stream_options.include_usage``: no choices, only usage."""
        body = self._base("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = []
        body["usage"] = openai_usage(usage)
        return body

    # --- whole responses ------------------------------------------------------------------------
    def response(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        """The non-streaming ``chat.completion`` or ``text_completion`` object."""
        if self.kind == "chat":
            body = self._base("chat.completion")
            body["choices"] = [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            ]
        else:
            body = self._base("text_completion")
            body["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
        body["usage"] = openai_usage(usage)
        return body
