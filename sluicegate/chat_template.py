"""Chat messages as chat templates read them, and rendering a template without transformers: the same
sandboxed Jinja environment and helpers transformers gives templates, so ingress (which has no model files, only
the template its workers publish) renders the prompt the worker will."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from schemas import ChatMessage


def _arguments(raw: str) -> Any:
    # Chat templates render a call's arguments with ``tojson``: they expect the object, not its text.
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (a tool call's arguments as the object they encode). OpenAI's
    ``developer`` role is its ``system`` role under a newer name: templates know only ``system`` (one that sees
    another role adds its default system prompt beside it), so it is rendered as ``system``."""
    role = "system" if message.role == "developer" else message.role
    rendered: dict[str, Any] = {"role": role, "content": message.text()}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        rendered["name"] = message.name
    return rendered


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def compile_template(source: str) -> Any:
    """A chat template compiled as transformers compiles it (trim_blocks, lstrip_blocks, loop controls,
    ``raise_exception``, ``strftime_now``, ``tojson`` without ASCII escapes)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
