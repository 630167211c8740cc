"""The ingress's OpenAPI document made accurate: request bodies (parsed by hand, so FastAPI cannot see them),
every response an operation can give with its schema and headers, and the two ways to present an API key.

Response models here only document shapes that :mod:`sluicegate.api.openai_format` and the endpoints build; they are
checked against real responses by the schemathesis test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from schemas import Tier
from sluicegate.api.bodies import ChatCompletionBody, CompletionBody, NativeRequestBody
from sluicegate.api.embeddings import EmbeddingBody

from .ratelimit import RATE_LIMIT_HEADERS
from .responses.bodies import ResponseCreateBody
from .tokenize_bodies import DetokenizeBody, TokenizeBody

_REF = "#/components/schemas/{model}"


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body."""

    error: ErrorDetail


class PromptTokensDetails(_Doc):
    cached_tokens: int = Field(ge=0)


class UsageOut(_Doc):
    """OpenAI's usage object."""

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails


class FunctionCallOut(_Doc):
    name: str
    arguments: str = Field(description="The call's arguments as JSON text.")


class ToolCallOut(_Doc):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(_Doc):
    role: Literal["assistant"]
    content: str | None = Field(description="Null when the answer is tool calls.")
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = Field(
        None,
        description="A reasoning model's thinking (its <think> span), apart from the answer; only for a model whose "
        "workers advertise a reasoning parser (streamed as delta.reasoning_content).",
    )


class TopLogprobOut(_Doc):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(_Doc):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class ChatChoice(_Doc):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class TextLogprobs(_Doc):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatCompletion(_Doc):
    """``chat.completion`` (non-streaming); with ``stream`` the body is ``text/event-stream`` of chunks."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageOut


class TextChoice(_Doc):
    index: int
    text: str
    logprobs: TextLogprobs | None = None
    finish_reason: str


class TextCompletion(_Doc):
    """``text_completion`` (non-streaming); with ``stream`` the body is ``text/event-stream`` of chunks."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[TextChoice]
    usage: UsageOut


class EmbeddingOut(_Doc):
    object: Literal["embedding"]
    index: int = Field(ge=0)
    embedding: list[float] | str = Field(description="Floats, or base64 of little-endian float32 (encoding_format).")


class EmbeddingUsage(_Doc):
    prompt_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class EmbeddingList(_Doc):
    """One L2-normalized embedding per input, in input order."""

    object: Literal["list"]
    data: list[EmbeddingOut]
    model: str
    usage: EmbeddingUsage


class ModelCard(_Doc):
    """A model with at least one live worker, or a LoRA adapter of one (``parent``: its base model)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    workers: int = Field(ge=0)
    description: str | None = Field(None, description="What the model's workers say of it, e.g. random weights.")
    architecture: str | None = Field(None, description="The model's architecture, e.g. Qwen3ForCausalLM.")
    deterministic: bool | None = Field(
        None,
        description="Every live worker of the model runs batch-invariant (SLUICEGATE_DETERMINISTIC): greedy and "
        "seeded answers do not depend on batching, caching or preemption. Absent for an adapter.",
    )
    deterministic_workers: int | None = Field(None, ge=0, description="How many of its live workers run deterministic.")
    warning: str | None = Field(None, description="Set when the model's workers mix deterministic and usual modes.")
    root: str | None = Field(None, description="An adapter's files (as vLLM shows them, credentials left out).")
    parent: str | None = Field(None, description="An adapter's base model (as vLLM shows it); null for a model.")


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class SubmitResponse(_Doc):
    """A request accepted onto its Kafka topic, with where and how to read its stream."""

    request_id: str
    status: Literal["queued"]
    model: str
    priority: Tier
    stream_url: str
    stream_token: str = Field(
        description="Pass as ?token= to the result service; opens only this request, until it expires (the "
        "request's longest life, SLUICEGATE_REQUEST_RECORD_TTL_S, plus the stream's retention, "
        "SLUICEGATE_STREAM_TTL_S); an expired one is refused (WebSocket 1008, HTTP 401) saying so."
    )


class CancelResponse(_Doc):
    request_id: str
    status: Literal["cancelling"]


class Health(_Doc):
    status: Literal["ok"]
    kafka_producer: Literal["started", "not_started"]


class Readiness(_Doc):
    status: Literal["ok", "unavailable"]
    kafka: str | None = None
    redis: str | None = None


_ERROR_DESCRIPTIONS = {
    400: "Malformed JSON, a field with an invalid value or over a per-key limit (prompt tokens, max_tokens), a "
    "parameter Sluicegate does not support, or a LoRA adapter a worker refused (its reason); param names the field.",
    401: "Missing or unknown API key.",
    403: "The operation needs an admin API key.",
    404: "Unknown model (no live worker) or LoRA adapter, or no such request for this key's tenant.",
    409: "The request already finished, or was cancelled; or the LoRA adapter's name is already registered.",
    413: "Body larger than the key's limit.",
    429: "Over the key's rate limits, the model's backlog is full (see Retry-After), or the request's deadline "
    "(X-Request-Deadline or the deadline field) cannot be met by the backlog (deadline_unmeetable).",
    500: "The worker failed the request.",
    503: "Kafka or Redis does not answer, or no worker verified a LoRA adapter in time; see Retry-After.",
    504: "No result within the request timeout or the request's deadline, or the deadline passed before the request "
    "was queued (deadline_exceeded).",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "string"}}}


def _rate_limit_doc(header: str) -> dict[str, Any]:
    what, unit = header.removeprefix("x-ratelimit-").split("-")
    description = (
        f"The key's {'per-minute request' if unit == 'requests' else 'token-per-minute'} limit: "
        + {"limit": "its size", "remaining": "what is left of it", "reset": "time until it is whole again"}[what]
        + (" (a Go duration such as 20ms, 1.5s, 6m0s)" if what == "reset" else "")
        + "; sent only when the key has that limit."
    )
    return {"description": description, "schema": {"type": "string"}}


_RATE_LIMITS = {header: _rate_limit_doc(header) for header in RATE_LIMIT_HEADERS}
_REQUEST_ID = {"x-request-id": {"description": "The request id.", "schema": {"type": "string"}}} | _RATE_LIMITS


# One server-sent event (OpenAPI 3.1: a stream's schema describes each event): ``data`` is an OpenAI chunk or
# error object as JSON, and the last event's data is ``[DONE]``.
_SSE_EVENT = {
    "type": "object",
    "properties": {
        "event": {"const": "message"},
        "data": {"type": "string", "description": "A chunk (or error) object as JSON, or [DONE] at the end."},
    },
    "required": ["data"],
}
_WITH_REQUEST_ID = frozenset({ChatCompletion, TextCompletion, SubmitResponse})


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for error statuses, each with the OpenAI error body."""
    documented: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]}
        if status == 429:
            entry["headers"] = _RETRY_AFTER | _RATE_LIMITS
        elif status == 503:
            entry["headers"] = _RETRY_AFTER
        documented[status] = entry
    return documented


def ok(model: type[BaseModel], *, status: int = 200, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """A response entry: ``model`` as JSON, plus server-sent events when the operation can stream."""
    entry: dict[str, Any] = {"model": model, "description": (model.__doc__ or "OK").strip()}
    if model in _WITH_REQUEST_ID:
        entry["headers"] = _REQUEST_ID
    if stream:
        entry["content"] = {"text/event-stream": {"schema": _SSE_EVENT}}
    return {status: entry}


def plain_text(description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 entry for a ``text/plain`` body."""
    return {200: {"description": description, "content": {"text/plain": {"schema": {"type": "string"}}}}}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` declaring ``model`` as the required JSON body."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


BODY_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionBody,
    CompletionBody,
    NativeRequestBody,
    EmbeddingBody,
    TokenizeBody,
    DetokenizeBody,
    ResponseCreateBody,
)

_SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer <API key>"},
    "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
}
_PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def install_openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """Replace ``app.openapi`` with one that adds the body schemas and security schemes; returns it."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        spec = get_openapi(
            title=app.title,
            version=app.version,
            summary=app.summary,
            description=app.description,
            routes=app.routes,
        )
        _, defs = models_json_schema([(m, "validation") for m in BODY_MODELS], ref_template=_REF)
        components = spec.setdefault("components", {})
        components.setdefault("schemas", {}).update(defs.get("$defs", {}))
        components["securitySchemes"] = _SECURITY_SCHEMES
        for path, operations in spec.get("paths", {}).items():
            for operation in operations.values():
                # FastAPI documents its own validation error as a 422; ingress answers it as OpenAI does, a 400 in
                # OpenAI's error shape.
                responses = operation.get("responses", {})
                if "HTTPValidationError" in str(responses.pop("422", {})):
                    responses.setdefault(
                        "400",
                        {
                            "description": _ERROR_DESCRIPTIONS[400],
                            "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}},
                        },
                    )
                if path not in _PUBLIC_PATHS:
                    operation["security"] = [{"bearer": []}, {"apiKey": []}]
        for name in ("HTTPValidationError", "ValidationError"):
            components["schemas"].pop(name, None)
        app.openapi_schema = spec
        return spec

    app.openapi = openapi  # type: ignore[method-assign]
    return openapi
