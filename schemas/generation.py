"""What a request may ask of generation beyond plain sampling, and what the stream gives back for it:
guided (constrained) decoding, tools the chat template renders, tool calls in the conversation, and per-token
log probabilities. The OpenAI surface maps ``response_format`` and ``tool_choice`` onto :class:`GuidedSpec`;
a Kafka-native producer may set it directly (regex, choice and EBNF grammars included)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from .common import Message

#: Most alternatives per token OpenAI (and vLLM) return in ``top_logprobs``.
MAX_TOP_LOGPROBS = 20


# ECMAScript's named group, which the grammar engine takes and Python's ``re`` spells ``(?P<name>``.
_NAMED_GROUP = re.compile(r"\(\?<(?=[A-Za-z_])")


def check_regex(pattern: str) -> str:
    """``pattern`` if it parses as a regular expression, else a ``ValueError`` saying where it breaks, so a request
    is refused where it is sent (a 400, a dead letter at the router) instead of by the worker's grammar compiler.
    Python's parser stands in for the grammar engine's (which would cost ingress half a GiB to import): both read
    the same syntax, so a broken pattern is caught here; what only the engine refuses (a lookahead, a backreference)
    is still refused by the worker."""
    try:
        re.compile(_NAMED_GROUP.sub("(?P<", pattern))
    except re.error as exc:
        raise ValueError(f"not a valid regular expression: {exc}") from None
    except RecursionError:
        raise ValueError("not a valid regular expression: nested too deeply") from None
    return pattern


class GuidedSpec(Message):
    """Constrain the output to exactly one of: a JSON Schema, any JSON object, a regex, one of some strings,
    or an EBNF grammar. The worker hands it to the engine's grammar matcher as a token mask."""

    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = Field(None, min_length=1, max_length=10_000)
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1024)] | None = None
    grammar: str | None = Field(None, min_length=1, max_length=100_000)

    @field_validator("regex")
    @classmethod
    def _parses(cls, value: str | None) -> str | None:
        return value if value is None else check_regex(value)

    @model_validator(mode="after")
    def _exactly_one(self) -> GuidedSpec:
        given = [
            name
            for name, value in (
                ("json_schema", self.json_schema is not None),
                ("json_object", self.json_object),
                ("regex", self.regex is not None),
                ("choice", self.choice is not None),
                ("grammar", self.grammar is not None),
            )
            if value
        ]
        if len(given) != 1:
            raise ValueError(
                "guided decoding takes exactly one of json_schema, json_object, regex, choice, grammar; "
                f"got {given or 'none'}"
            )
        return self


class FunctionSpec(Message):
    """A function the model may call, as OpenAI describes it."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(Message):
    """One tool offered to the model (rendered by the chat template)."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionCall(Message):
    """A call's function name and its JSON arguments, as a string (OpenAI's shape)."""

    name: str = Field(min_length=1, max_length=64)
    arguments: str


class ToolCall(Message):
    """A tool call an assistant message made earlier in the conversation."""

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


#: How a model writes tool calls in plain text, from its chat template (advertised in heartbeats):
#: ``hermes``: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``; ``llama3_json``: a JSON object
#: ``{"name": ..., "parameters": ...}``, possibly after ``<|python_tag|>``.
ToolCallFormat = Literal["hermes", "llama3_json"]

#: How a reasoning model's output splits into thinking and answer (advertised in heartbeats; vLLM's parser names):
#: both read a ``<think>...</think>`` span at the start; ``qwen3`` expects the model to open it, ``deepseek_r1``
#: expects the prompt to have opened it when that cannot be seen (``sluicegate.api.reasoning``).
ReasoningParser = Literal["qwen3", "deepseek_r1"]


#: A token's raw bytes (part of a multi-byte character, when the token holds one), which its ``token`` text cannot
#: carry; None from a producer that does not send them (then the text's UTF-8 stands in).
RawTokenBytes = Annotated[
    list[Annotated[int, Field(ge=0, le=255)]] | None, Field(description="The token's raw bytes.", max_length=1024)
]


class TopLogprob(Message):
    """One alternative for a sampled position."""

    token_id: int = Field(ge=0)
    token: str
    logprob: float
    bytes: RawTokenBytes = None


class TokenLogprob(Message):
    """The sampled token's log probability (from the model's raw logits) and the top alternatives."""

    token_id: int = Field(ge=0)
    token: str
    logprob: float
    bytes: RawTokenBytes = None
    top: list[TopLogprob] = Field(default_factory=list, max_length=MAX_TOP_LOGPROBS)
