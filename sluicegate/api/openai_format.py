"""OpenAI response objects built from Sluicegate results: ``chat.completion(.chunk)``, ``text_completion``,
usage, and server-sent-event framing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from schemas import TokenLogprob, TopLogprob, Usage

from .errors import ApiError

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

#: Worker error codes a retry of the same request cannot help: a deadline already passed, a request cancelled on
#: purpose. The OpenAI SDKs retry every 409 and 5xx unless told not to (``x-should-retry: false``).
NOT_RETRYABLE = frozenset({"deadline_exceeded", "cancelled"})

SSE_DONE = "data: [DONE]\n\n"


def worker_failure(code: str, message: str) -> ApiError:
    """The HTTP error for a request whose stream ended in the worker's ``error`` event with ``code``."""
    headers = {"x-should-retry": "false"} if code in NOT_RETRYABLE else None
    return ApiError(ERROR_STATUS.get(code, 500), message, code=code, headers=headers)


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as compact JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _bytes(lp: TokenLogprob | TopLogprob) -> list[int]:
    """The token's raw bytes as the worker sent them (a partial UTF-8 character included); else its text's."""
    return lp.bytes if lp.bytes is not None else list(lp.token.encode("utf-8", errors="replace"))


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's ``logprobs`` object: ``content`` entries with token, logprob, bytes, top_logprobs."""
    content = [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "bytes": _bytes(lp),
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": _bytes(t)} for t in lp.top],
        }
        for lp in logprobs
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(logprobs: list[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """A completion choice's legacy ``logprobs`` object (parallel lists; top alternatives as dicts).

    Each position's alternatives include the sampled token, as OpenAI's legacy API (and vLLM) give them: up to
    ``logprobs`` + 1 entries when sampling chose a token outside the top ones. Chat's ``top_logprobs`` stay the
    top ones only, as OpenAI's chat API gives them."""
    offsets = []
    tops = []
    for lp in logprobs:
        offsets.append(text_offset)
        text_offset += len(lp.token)
        top = {t.token: t.logprob for t in lp.top}
        top.setdefault(lp.token, lp.logprob)
        tops.append(top)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def openai_usage(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage object, with cached prompt tokens in ``prompt_tokens_details``, and ``cached: true`` on a
    reply the response cache served (the one thing that tells a client so)."""
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.cached:
        body["cached"] = True
    return body


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The usage one chunk of a ``continuous_usage_stats`` stream carries: the tokens so far, as vLLM counts them."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
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
    def choices_chunk(
        self, choices: list[dict[str, Any]], *, include_usage: bool = False, usage: dict[str, int] | None = None
    ) -> dict[str, Any]:
        """A chunk carrying already-shaped choices (chat: ``index``/``delta``...; completion: ``index``/``text``...).

        With ``include_usage`` the chunk carries ``usage``: null as OpenAI sends it, or the running counts of
        :func:`running_usage` (vLLM's ``continuous_usage_stats``).
        """
        body = self._base("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = choices
        if include_usage:
            body["usage"] = usage
        return body

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
    def choices_response(self, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        """The non-streaming object around already-shaped choices."""
        body = self._base("chat.completion" if self.kind == "chat" else "text_completion")
        body["choices"] = choices
        body["usage"] = openai_usage(usage)
        return body

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
