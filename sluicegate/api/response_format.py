"""OpenAI's ``response_format`` and ``tool_choice`` bodies, and the one place they become a
:class:`schemas.GuidedSpec`: JSON mode, a JSON Schema (``strict`` or not, the grammar enforces it either way),
or the schema of a forced tool call (a named function: its parameters; ``required``: a list of calls)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from schemas import GuidedSpec, ToolSpec


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextFormat(_Body):
    """Plain text (the default)."""

    type: Literal["text"]


class JsonObjectFormat(_Body):
    """JSON mode: any JSON object."""

    type: Literal["json_object"]


#: What JSON Schema cannot say of a field that holds one.
JSON_SCHEMA_DESCRIPTION = "A JSON Schema (draft 2020-12) the output must match; one that is not valid is a 400."


class JsonSchemaSpec(_Body):
    """``response_format.json_schema``."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description=JSON_SCHEMA_DESCRIPTION)
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            try:
                Draft202012Validator.check_schema(value)
            except SchemaError as exc:
                raise PydanticCustomError(
                    "invalid_json_schema", "not a valid JSON Schema: {reason}", {"reason": exc.message}
                ) from None
        return value


class JsonSchemaFormat(_Body):
    """Structured output under a JSON Schema."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class NamedFunction(_Body):
    # A tool's name pattern (schemas.FunctionSpec): no other name can be one of ``tools``.
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="One of the tools' names.")


class NamedToolChoice(_Body):
    """``{"type": "function", "function": {"name": ...}}``: call exactly this function."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _parameters(tool: ToolSpec) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def required_calls_schema(tools: list[ToolSpec], parallel: bool | None) -> dict[str, Any]:
    """``tool_choice: required``: a JSON list of one or more ``{"name", "parameters"}`` calls."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.function.name}, "parameters": _parameters(tool)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def effective_tool_choice(tools: list[ToolSpec] | None, choice: ToolChoice | None) -> ToolChoice:
    """OpenAI's default: ``auto`` when tools are given, ``none`` otherwise."""
    if choice is not None:
        return choice
    return "auto" if tools else "none"


def guided_for(
    tools: list[ToolSpec] | None,
    tool_choice: ToolChoice | None,
    response_format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None,
    parallel_tool_calls: bool | None,
    regex: str | None = None,
) -> GuidedSpec | None:
    """The grammar a body asks for; a ``PydanticCustomError`` naming the parameter for contradictions.

    ``regex`` is vLLM's ``guided_regex`` extra: it combines with no other constraint, but with
    ``tool_choice`` 'auto' (the model may then be made to write a call in its own format)."""
    if regex is not None:
        if guided_for(tools, tool_choice, response_format, parallel_tool_calls) is not None:
            raise PydanticCustomError(
                "conflicting_constraints",
                "guided_regex cannot be combined with response_format or a forced tool_choice",
            )
        return GuidedSpec(regex=regex)
    choice = effective_tool_choice(tools, tool_choice)
    forced: dict[str, Any] | None = None
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools or [] if t.function.name == choice.function.name]
        if not named:
            raise PydanticCustomError(
                "unknown_tool",
                "tool_choice names function '{name}', which is not in 'tools'",
                {"name": choice.function.name},
            )
        forced = _parameters(named[0])
    elif choice == "required":
        if not tools:
            raise PydanticCustomError("tools_missing", "tool_choice 'required' needs 'tools'")
        forced = required_calls_schema(tools, parallel_tool_calls)
    if forced is not None:
        if response_format is not None and response_format.type != "text":
            raise PydanticCustomError(
                "conflicting_constraints", "response_format cannot be combined with a forced tool_choice"
            )
        return GuidedSpec(json_schema=forced)
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GuidedSpec(json_object=True)
    schema = response_format.json_schema.schema_
    return GuidedSpec(json_schema=schema) if schema is not None else GuidedSpec(json_object=True)
