"""Turning a choice's generated text into OpenAI tool calls, whole or as streamed deltas.

How the text is read depends on the request (:class:`ToolPlan`): a named ``tool_choice`` makes the whole
output the function's JSON arguments (the grammar forced it), ``required`` makes it a JSON list of
``{"name", "parameters"}`` calls, and ``auto`` reads the model's own format, which its worker advertises from
the chat template: Hermes-style ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks after
optional content, or Llama-3.1-style JSON ``{"name": ..., "parameters": ...}`` (optionally behind
``<|python_tag|>``, several separated by ``;``). Text that does not parse as calls of offered tools stays content.

Streamed, calls are read as they are written by :mod:`sluicegate.api.tool_call_stream`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from schemas import ToolCallFormat, ToolSpec
from sluicegate import json_input

from .response_format import NamedToolChoice, ToolChoice, effective_tool_choice

Mode = Literal["content", "named", "required", "auto"]

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """How one request's output is read."""

    mode: Mode = "content"
    named: str | None = None
    tool_names: frozenset[str] = frozenset()
    fmt: ToolCallFormat | None = None


def plan_for(tools: list[ToolSpec] | None, choice: ToolChoice | None, fmt: ToolCallFormat | None) -> ToolPlan:
    """The reading plan for a chat body's ``tools`` and ``tool_choice``."""
    effective = effective_tool_choice(tools, choice)
    names = frozenset(t.function.name for t in tools or [])
    if isinstance(effective, NamedToolChoice):
        return ToolPlan("named", effective.function.name, names, fmt)
    if effective == "none" or not tools:
        return ToolPlan()
    return ToolPlan(effective, None, names, fmt)  # type: ignore[arg-type]


def new_call_id() -> str:
    """An id in OpenAI's style."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def _named_call(obj: Any, names: frozenset[str], args_key: tuple[str, ...]) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    for key in args_key:
        if key in obj:
            return _call(obj["name"], obj[key] if obj[key] is not None else {})
    return _call(obj["name"], {})


def _hermes(text: str, names: frozenset[str]) -> tuple[str | None, list[dict[str, Any]]] | None:
    start = text.find(HERMES_OPEN)
    if start == -1:
        return None
    calls = []
    for block in _HERMES_BLOCK.findall(text[start:]):
        try:
            call = _named_call(json_input.loads(block), names, ("arguments", "parameters"))
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    content = text[:start].strip()
    return (content or None), calls


def _llama(text: str, names: frozenset[str]) -> tuple[str | None, list[dict[str, Any]]] | None:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].strip()
    if not body.startswith("{"):
        return None
    calls = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = json_input.raw_decode(body, pos)
        except ValueError:
            return None
        call = _named_call(obj, names, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls


def parse_output(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]] | None]:
    """``(content, tool_calls)`` of a finished choice; ``tool_calls`` is None when it made none."""
    if plan.mode == "content":
        return text, None
    if plan.mode == "named":
        assert plan.named is not None
        return None, [_call(plan.named, text)]
    if plan.mode == "required":
        try:
            items = json_input.loads(text)
        except ValueError:
            return text, None  # cut short (max_tokens): what there is, as content
        calls = [_named_call(item, plan.tool_names, ("parameters",)) for item in items if isinstance(items, list)]
        if not calls or any(c is None for c in calls):
            return text, None
        return None, calls  # type: ignore[return-value]
    parsers = {"hermes": (_hermes,), "llama3_json": (_llama,), None: (_hermes, _llama)}[plan.fmt]
    for parser in parsers:
        parsed = parser(text, plan.tool_names)
        if parsed is not None and parsed[1]:
            return parsed
    return text, None


def call_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Message deltas for whole calls: per call its header (index, id, type, name), then its arguments."""
    deltas: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        head = {
            "index": index,
            "id": call["id"],
            "type": "function",
            "function": {"name": call["function"]["name"], "arguments": ""},
        }
        deltas.append({"tool_calls": [head]})
        if call["function"]["arguments"]:
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]})
    return deltas
