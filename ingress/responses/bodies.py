"""``POST /v1/responses``'s body, and the chat completion body it becomes: a response is queued, limited,
routed, counted and served exactly as a chat completion is (``ingress.accept``), with ``instructions`` as the
system message, the conversation's items as chat messages, ``max_output_tokens`` as ``max_completion_tokens``,
``text.format`` as ``response_format`` (the grammar path) and function ``tools`` / ``tool_choice`` in the chat
shape (the chat path's tool-call parsing reads the output).

Fields Sluicegate does not implement are refused by name with a 400 (``reasoning``, ``include``, ``truncation``
"auto", ``conversation``, ``prompt``, ``top_logprobs``, ``text.verbosity`` other than "medium", built-in tools and
their ``tool_choice``), unknown fields too; fields that change nothing (``user``, ``safety_identifier``,
``prompt_cache_key``, ``prompt_cache_retention``, ``service_tier``, ``metadata``, ``max_tool_calls``, which counts
built-in tool calls only...) are accepted and echoed. Sluicegate's extras (in the SDK's
``extra_body``) are the chat path's: ``priority``, ``seed`` and ``ignore_eos``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from schemas import EndUser, Tier
from sluicegate.api.bodies import ChatCompletionBody
from sluicegate.api.bodies.base import MODEL_DESCRIPTION
from sluicegate.api.errors import ApiError, invalid
from sluicegate.api.response_format import JSON_SCHEMA_DESCRIPTION, JsonSchemaSpec
from sluicegate.api.schema_rules import any_of, every, given, has, rules

from .items import InputItem, unsupported

#: Response ids: ``resp_`` and the pipeline's request id.
RESPONSE_ID = re.compile(r"resp_[A-Za-z0-9]{1,120}")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _only(*values: Any, description: str = "Not supported beyond these values.") -> WithJsonSchema:
    return WithJsonSchema({"enum": list(values), "description": description})


class FunctionTool(_Body):
    """A function the model may call (the Responses shape: name and parameters at the top level)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class BuiltInTool(BaseModel):
    """Any other tool (web_search, file_search, computer use, MCP...): refused by name."""

    type: str
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _refuse(self) -> BuiltInTool:
        raise unsupported(f"built-in tools are not supported ({self.type!r}); only 'function' tools")


def _type_of(value: Any) -> Any:
    """A union member's ``type``, from the raw dict being validated or from a model being serialized."""
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


def _function_or_other(value: Any) -> str:
    return "function-tool" if _type_of(value) == "function" else "other-tool"


Tool = Annotated[
    Annotated[FunctionTool, Tag("function-tool")] | Annotated[BuiltInTool, Tag("other-tool"), SkipJsonSchema()],
    Discriminator(_function_or_other),
]


class FunctionChoice(_Body):
    """``{"type": "function", "name": ...}``: call exactly this function."""

    type: Literal["function"]
    # A tool's name pattern (FunctionTool): no other name can be one of ``tools``.
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="One of the tools' names.")


class OtherChoice(BaseModel):
    """A built-in tool's (or ``allowed_tools``) choice: refused by name."""

    type: str
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _refuse(self) -> OtherChoice:
        raise unsupported(f"tool_choice of type {self.type!r} is not supported; only 'function'")


ToolChoice = (
    Literal["none", "auto", "required"]
    | Annotated[
        Annotated[FunctionChoice, Tag("function-tool")] | Annotated[OtherChoice, Tag("other-tool"), SkipJsonSchema()],
        Discriminator(_function_or_other),
    ]
)


class TextFormatText(_Body):
    type: Literal["text"]


class TextFormatJsonObject(_Body):
    type: Literal["json_object"]


class TextFormatJsonSchema(JsonSchemaSpec):
    """Structured output under a JSON Schema (the chat ``json_schema`` spec, flattened). Unlike chat's, the
    Responses API requires the schema: without one a client's mistake would quietly become "any JSON"."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description=JSON_SCHEMA_DESCRIPTION)


def _format_kind(value: Any) -> str | None:
    kind = _type_of(value)
    return f"{kind}-format" if kind in ("text", "json_object", "json_schema") else None


# Tagged "<type>-format" rather than by the type itself: a plain tag would name an error's field
# "text.format.json_schema.schema", where the client wrote text.format.schema (tags with "-" stay out of the path).
TextFormat = Annotated[
    Annotated[TextFormatText, Tag("text-format")]
    | Annotated[TextFormatJsonObject, Tag("json_object-format")]
    | Annotated[TextFormatJsonSchema, Tag("json_schema-format")],
    Discriminator(
        _format_kind,
        custom_error_type="invalid_format_type",
        custom_error_message="type must be 'text', 'json_object' or 'json_schema'",
    ),
]


class TextConfig(_Body):
    """``text``: the output's format."""

    format: TextFormat | None = None
    verbosity: Annotated[Literal["low", "medium", "high"] | None, _only("medium", None)] = None

    @field_validator("verbosity")
    @classmethod
    def _medium(cls, value: str | None) -> str | None:
        if value not in (None, "medium"):
            raise unsupported("text.verbosity other than 'medium' is not supported")
        return value


class ResponseStreamOptions(_Body):
    include_obfuscation: bool | None = None


_NOT_SUPPORTED = "this parameter is not supported"


# The tool_choice values that force no call; any other (required, a named function) forces one.
_NOT_FORCED = has("tool_choice", {"enum": ["none", "auto", None]})
_PLAIN_TEXT = has(
    "text",
    {
        "anyOf": [
            {"type": "null"},
            has("format", {"anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]}),
        ]
    },
)

#: The chat path's rules between fields (``ChatCompletionBody``'s, under the Responses names), and this API's own.
RESPONSE_RULES = (
    # A forced tool_choice needs tools to call, and leaves no room for a text.format.
    any_of(_NOT_FORCED, every(given("tools", {"type": "array", "minItems": 1}), _PLAIN_TEXT)),
    # background needs store.
    any_of(has("background", {"enum": [False, None]}), has("store", {"enum": [True, None]})),
)


class ResponseCreateBody(_Body):
    """``POST /v1/responses``."""

    model_config = ConfigDict(json_schema_extra=rules(*RESPONSE_RULES))

    model: str = Field(min_length=1, max_length=256, description=MODEL_DESCRIPTION)
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1, max_length=4096)] = (
        Field(
            description="Text, or items; a function_call_output must answer a function_call (by call_id) earlier in "
            "the conversation."
        )
    )
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = Field(
        None, description="'required' or a named function needs tools; a named function must be one of them."
    )
    parallel_tool_calls: bool | None = None
    store: bool | None = Field(None, description="Keep the response (default true): GET, input_items, chaining.")
    background: bool | None = Field(None, description="Queue it and answer at once; needs store.")
    previous_response_id: str | None = Field(
        None,
        pattern=RESPONSE_ID.pattern,
        description="A stored response of the key's tenant that has ended; a missing one is a 404 not_found.",
    )
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16
    )
    stream: bool | None = None
    stream_options: ResponseStreamOptions | None = None
    user: EndUser | None = None
    safety_identifier: str | None = Field(None, max_length=64)
    prompt_cache_key: str | None = Field(None, max_length=1024)
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None
    service_tier: str | None = Field(None, max_length=32)
    priority: Tier | None = Field(None, description="Sluicegate's tier (extra_body).")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Sampling seed (extra_body, as on chat).")
    ignore_eos: bool = Field(False, description="vLLM-style: generate to max_output_tokens (extra_body).")
    reasoning: Annotated[Any, _only(None, description="Reasoning is not supported.")] = None
    include: Annotated[list[str] | None, _only(None, description="Nothing can be included.")] = None
    truncation: Annotated[Literal["auto", "disabled"] | None, _only("disabled", None)] = None
    conversation: Annotated[Any, _only(None, description="Conversations are not supported.")] = None
    prompt: Annotated[Any, _only(None, description="Prompt templates are not supported.")] = None
    top_logprobs: Annotated[int | None, _only(0, None)] = None
    # OpenAI's cap on calls to built-in tools (web search...), which are refused here: it changes nothing.
    max_tool_calls: int | None = Field(None, ge=1)

    @field_validator("reasoning", "conversation", "prompt")
    @classmethod
    def _absent(cls, value: Any) -> Any:
        if value is not None:
            raise unsupported(_NOT_SUPPORTED)
        return value

    @field_validator("include")
    @classmethod
    def _nothing_included(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise unsupported(f"include is not supported ({', '.join(map(repr, value))})")
        return value

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, value: str | None) -> str | None:
        if value == "auto":
            raise unsupported("truncation 'auto' is not supported; the input must fit the model's context")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise unsupported("top_logprobs is not supported on /v1/responses")
        return value

    @property
    def stored(self) -> bool:
        """``store``, true unless given false."""
        return self.store is not False


# Chat parameter paths -> the Responses parameter a client gave (longest prefix first).
_PARAMS = (
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("messages", "input"),
)


def responses_error(exc: ApiError) -> ApiError:
    """An error of the chat path reworded for the Responses parameter it is about."""
    param = exc.param
    message = exc.message
    for chat, ours in _PARAMS:
        if param is not None and (param == chat or param.startswith(chat + ".")):
            param = ours if chat == "messages" else ours + param[len(chat) :]
        # A message's place is not an input item's (instructions, merged calls): name the input as a whole.
        message = re.sub(r"'messages[^']*'", "'input'", message) if chat == "messages" else message
        message = message.replace(f"'{chat}", f"'{ours}")
    if param is not None and param.startswith("tools.") and ".function." in param:
        param = param.replace(".function.", ".", 1)
    message = re.sub(r"'(tools\.\d+)\.function\.", r"'\1.", message)
    return ApiError(exc.status, message, code=exc.code, param=param, type_=exc.type, headers=exc.headers)


def _chat_tool_choice(choice: Any) -> Any:
    return {"type": "function", "function": {"name": choice.name}} if isinstance(choice, FunctionChoice) else choice


def _chat_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or isinstance(fmt, TextFormatText):
        return None
    if isinstance(fmt, TextFormatJsonObject):
        return {"type": "json_object"}
    spec = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
    return {"type": "json_schema", "json_schema": spec}


def chat_body(body: ResponseCreateBody, messages: list[dict[str, Any]]) -> ChatCompletionBody:
    """The chat completion body that serves ``body`` over ``messages`` (the conversation so far and the input);
    the chat path's checks apply, their errors named for the Responses parameters."""
    tools = [
        {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
        for tool in body.tools or []
    ]
    data = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": tools or None,
        "tool_choice": _chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _chat_format(body.text),
        "user": body.user,
        "priority": body.priority,
        "seed": body.seed,
        "ignore_eos": body.ignore_eos or None,
    }
    try:
        return ChatCompletionBody.model_validate({k: v for k, v in data.items() if v is not None})
    except ValidationError as exc:
        raise responses_error(invalid(exc, root_field="messages")) from exc


def echo_fields(body: ResponseCreateBody) -> dict[str, Any]:
    """What the response object repeats of the request, as OpenAI does (defaults filled in)."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "prompt_cache_key": body.prompt_cache_key,
        "prompt_cache_retention": body.prompt_cache_retention,
        "reasoning": {"effort": None, "summary": None},
        "safety_identifier": body.safety_identifier,
        "service_tier": "default",
        "store": body.stored,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {
            "format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"},
            "verbosity": "medium",
        },
        "tool_choice": (
            body.tool_choice.model_dump()
            if isinstance(body.tool_choice, BaseModel)
            else body.tool_choice or "auto"  # OpenAI's default, with tools or without
        ),
        "tools": [tool.model_dump() for tool in body.tools or []],
        "top_logprobs": 0,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "user": body.user,
    }
