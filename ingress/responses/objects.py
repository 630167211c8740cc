"""What a response is made of: its record (everything about it fixed when it is created, kept in Redis for a
stored response so that any ingress renders it, and its events, identically), and the pieces of OpenAI's
``response`` object built from a result (usage, error, the object itself)."""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas import ToolCallFormat, Usage
from sluicegate.api.tool_calls import Mode, ToolPlan

Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"completed", "incomplete", "failed", "cancelled"})


class PlanSpec(BaseModel):
    """How the output is read for tool calls (:class:`sluicegate.api.tool_calls.ToolPlan`), kept with the record
    so every ingress reads a stream the same way (the tool-call format comes from the workers' heartbeats when
    the response is accepted)."""

    mode: Mode = "content"
    named: str | None = None
    tool_names: list[str] = Field(default_factory=list)
    fmt: ToolCallFormat | None = None

    @classmethod
    def of(cls, plan: ToolPlan) -> PlanSpec:
        return cls(mode=plan.mode, named=plan.named, tool_names=sorted(plan.tool_names), fmt=plan.fmt)

    def plan(self) -> ToolPlan:
        return ToolPlan(self.mode, self.named, frozenset(self.tool_names), self.fmt)


class ResponseRecord(BaseModel):
    """A response as fixed when it was accepted."""

    model_config = ConfigDict(extra="ignore")

    id: str
    request_id: str
    tenant: str
    created_at: int
    model: str
    background: bool = False
    #: The fields the response object repeats from the request (``bodies.echo_fields``).
    echo: dict[str, Any] = Field(default_factory=dict)
    plan: PlanSpec = Field(default_factory=PlanSpec)
    #: This response's own input, in stored form with ids (``input_items`` lists them).
    input_items: list[dict[str, Any]] = Field(default_factory=list)
    #: The responses this one continues, oldest first (``previous_response_id``, its own chain before it).
    chain: list[str] = Field(default_factory=list)


def openai_usage(usage: Usage) -> dict[str, Any]:
    """The Responses API's usage object."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


# Worker error codes that mean the input could not be served as given; the rest are the server's.
_PROMPT_ERRORS = frozenset({"invalid_request", "prompt_too_long", "context_length_exceeded"})


def response_error(code: str, message: str) -> dict[str, Any]:
    """A failed response's ``error``: OpenAI's codes (``invalid_prompt`` or ``server_error``)."""
    return {"code": "invalid_prompt" if code in _PROMPT_ERRORS else "server_error", "message": message}


def response_object(
    record: ResponseRecord,
    *,
    status: Status,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    incomplete_details: dict[str, Any] | None = None,
    completed_at: int | None = None,
) -> dict[str, Any]:
    """OpenAI's ``response`` object (a deep copy of ``output``: later events must not change it)."""
    return {
        "id": record.id,
        "object": "response",
        "created_at": record.created_at,
        "completed_at": completed_at,
        "status": status,
        "background": record.background,
        "error": error,
        "incomplete_details": incomplete_details,
        "model": record.model,
        "output": copy.deepcopy(output),
        "usage": usage,
        **record.echo,
    }
