"""Streaming one choice's tool calls the way OpenAI does, while the model is still writing them.

Per call: a first delta with ``index``, ``id``, ``type`` and the function name (arguments ``""``), then the
arguments in fragments as they are generated, one ``index`` per call. A named ``tool_choice`` makes the whole
output the arguments. For ``auto`` and ``required`` an incremental parser reads the model's format
(:mod:`sluicegate.api.tool_calls` says which): Hermes ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
blocks after optional content, Llama-3.1 JSON ``{"name": ..., "parameters": ...}`` objects (optionally behind
``<|python_tag|>``, separated by ``;``), or the ``required`` grammar's JSON list of such objects.

Text that may still become the start of a call is held back, and released as content once it cannot. A call
is committed (its header sent) only once its head ``{"name": "<offered tool>", "arguments":`` is complete;
a head the parser cannot follow (keys in another order, say) is held to the choice's end and read whole.
Prefix matching of the head uses the ``regex`` package's partial matches (``partial=True``), which answer
"could this buffer still grow into a match" directly instead of a hand-written automaton.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import regex

from .tool_calls import HERMES_OPEN, PYTHON_TAG, ToolPlan, call_deltas, new_call_id, parse_output

# content: Hermes-style prose that a ``<tool_call>`` may follow; prose: text that no call can follow; open: a
# call's head is being written; args: its arguments; close: what ends it; after: text past the last call;
# fallback: a head the parser cannot follow, held and read whole at the end.
State = Literal["content", "prose", "open", "args", "close", "after", "fallback"]

_HEAD = r'\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
# Per format: (what opens the first call, what opens each next one, what closes a call after its arguments).
_SYNTAX: dict[str, tuple[str, str, str]] = {
    "hermes": (
        regex.escape(HERMES_OPEN) + r"\s*",
        r"\s*" + regex.escape(HERMES_OPEN) + r"\s*",
        r"\s*\}\s*</tool_call>",
    ),
    "llama3_json": (r"\s*(?:" + regex.escape(PYTHON_TAG) + r"\s*)?", r"[\s;]*", r"\s*\}"),
    "required": (r"\s*\[\s*", r"\s*,\s*", r"\s*\}"),
}
_COMPILED = {
    fmt: (regex.compile(first + _HEAD), regex.compile(following + _HEAD), regex.compile(close))
    for fmt, (first, following, close) in _SYNTAX.items()
}


@dataclass
class _ValueScanner:
    """Finds where one JSON value ends in text that arrives in pieces (strings and escapes respected)."""

    started: bool = False
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    scalar: bool = False  # a bare number/true/false/null: it ends at the first delimiter
    quoted: bool = False  # a JSON string (arguments some models write as an encoded object)

    def scan(self, text: str) -> tuple[int, int, bool]:
        """``(skip, upto, ended)``: leading whitespace to drop, where the value's text ends in ``text``, and
        whether the value is complete there."""
        skip = 0
        for i, char in enumerate(text):
            if not self.started:
                if char.isspace():
                    skip = i + 1
                    continue
                self.started = True
                self.scalar = char not in '{["'
                self.quoted = char == '"'
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return skip, i + 1, True
            elif self.scalar:
                if char.isspace() or char in ",}]":
                    return skip, i, True
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return skip, i + 1, True
        return skip, len(text), False


@dataclass
class ToolCallStream:
    """One choice's streamed message deltas (``content`` or ``tool_calls``) under a plan."""

    plan: ToolPlan
    called: bool = False
    _state: State = "content"
    _syntax: str = "hermes"
    _buf: str = ""  # text not yet relayed or consumed
    _index: int = 0  # the next call's index
    _decided: bool = False  # auto: whether the output is Llama-style JSON or Hermes-style text is known
    _scanner: _ValueScanner = field(default_factory=_ValueScanner)
    _quoted: str = ""  # a string-valued arguments literal, until it is complete

    def __post_init__(self) -> None:
        if self.plan.mode == "required":
            self._state, self._syntax, self._decided = "open", "required", True

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas to send for new text."""
        if not text:
            return []
        mode = self.plan.mode
        if mode == "content":
            return [{"content": text}]
        if mode == "named":
            out: list[dict[str, Any]] = []
            if not self.called:
                assert self.plan.named is not None
                out.append(self._header(self.plan.named))
            return [*out, self._arguments(0, text)]
        self._buf += text
        if not self._decided and not self._decide():
            return []
        out = []
        while True:
            step = self._step()
            if step is None:
                return out
            out += step

    def finish(self) -> list[dict[str, Any]]:
        """What is still held when the choice ends."""
        held, self._buf = self._buf, ""
        if self.plan.mode in ("content", "named") or not held:
            return []
        if self._state == "content" or (not self._decided and not self._index):
            return [{"content": held}]
        if self._state in ("open", "fallback"):
            plan = self.plan if self._syntax == "required" else ToolPlan("auto", None, self.plan.tool_names, None)
            content, calls = parse_output(held, plan)
            if calls:
                self.called = True
                deltas = call_deltas(calls)
                for delta in deltas:
                    for call in delta["tool_calls"]:
                        call["index"] += self._index
                return ([{"content": content}] if content else []) + deltas
            if self._syntax == "required":
                return []  # the grammar's list around a call cut before its name ended: never content
            if self._state == "fallback" or not self._index:
                return [{"content": held}]
        return []  # the tail of a call, or text after the last one: not part of any call

    def _decide(self) -> bool:
        """Auto: Llama-style output opens with its call (``{`` or ``<|python_tag|>``); otherwise it is content
        that a Hermes ``<tool_call>`` block may follow. False while the opening cannot tell yet."""
        stripped = self._buf.lstrip()
        if not stripped or (self.plan.fmt != "hermes" and PYTHON_TAG.startswith(stripped) and stripped != PYTHON_TAG):
            return False
        self._decided = True
        llama = self.plan.fmt in ("llama3_json", None) and (stripped[0] == "{" or stripped.startswith(PYTHON_TAG))
        if llama:
            self._state, self._syntax = "open", "llama3_json"
        elif self.plan.fmt == "llama3_json":
            self._state = "prose"
        return True

    def _step(self) -> list[dict[str, Any]] | None:
        """Advance on the buffer; None when nothing more can be done until more text arrives."""
        state, buf = self._state, self._buf
        if not buf:
            return None
        if state == "prose":
            self._buf = ""
            return [{"content": buf}]
        if state == "content":
            marker = buf.find(HERMES_OPEN)
            keep = len(buf) - marker if marker != -1 else _partial_suffix(buf, HERMES_OPEN)
            out, self._buf = buf[: len(buf) - keep], buf[len(buf) - keep :]
            if marker != -1:
                self._state = "open"
            elif not out:
                return None
            return [{"content": out}] if out else []
        if state == "open":
            first, following, _ = _COMPILED[self._syntax]
            match = (following if self._index else first).match(buf, partial=True)
            if match is not None and match.partial:
                return None
            name = _json_string(match.group("name")) if match is not None else None
            if name is None or name not in self.plan.tool_names:
                self._state = "after" if self._index else "fallback"
                return None
            self._buf, self._state, self._scanner, self._quoted = buf[match.end() :], "args", _ValueScanner(), ""
            return [self._header(name)]
        if state == "args":
            skip, upto, ended = self._scanner.scan(buf)
            piece, self._buf = buf[skip:upto], buf[upto:]
            if self._scanner.quoted:  # arguments as a JSON string: sent whole, as the text it encodes
                self._quoted += piece
                piece = (_json_string(self._quoted[1:-1]) or "") if ended else ""
            out = [self._arguments(self._index, piece)] if piece else []
            if ended:
                self._state, self._index = "close", self._index + 1
            return out if out or ended else None
        if state == "close":
            match = _COMPILED[self._syntax][2].match(buf, partial=True)
            if match is not None and match.partial:
                return None
            self._state = "open" if match is not None else "after"
            self._buf = buf[match.end() :] if match is not None else buf
            return []
        if state == "after":
            self._buf = ""  # text after the last call is not part of the message (as when read whole)
        return None  # fallback: held to the end

    def _header(self, name: str) -> dict[str, Any]:
        self.called = True
        index = self._index
        head = {"index": index, "id": new_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
        return {"tool_calls": [head]}

    @staticmethod
    def _arguments(index: int, text: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


def _json_string(raw: str) -> str | None:
    try:
        value = json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
