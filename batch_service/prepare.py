"""Validating a batch: every input line checked and turned into the pipeline's ``InferenceRequest`` by the request
building ingress uses too (the body models of :mod:`sluicegate.api.bodies`, the key's limits of
:mod:`sluicegate.api.limits`, :func:`sluicegate.api.build.build_request`), so a line is judged exactly as the online
API would judge the same call.

A line whose body the online API would refuse becomes an error line carrying that refusal (status, code, message,
field); a file that is no longer a valid batch file (unreadable line, duplicate custom_id) fails the batch, naming
the line. The requests go to a "prepared" JSONL file next to the input, cut into chunks the enqueuer publishes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from schemas import InferenceRequest, ToolCallFormat, TraceContext, batch_request_id
from sluicegate.api.bodies import ChatCompletionBody, CompletionBody, EmbeddingInput
from sluicegate.api.build import build_request
from sluicegate.api.embeddings import EmbeddingBody
from sluicegate.api.errors import ApiError, invalid
from sluicegate.api.limits import Limits, check_context, check_prompt_tokens, checked_max_tokens
from sluicegate.api.tool_calls import Mode, ToolPlan, plan_for
from sluicegate.batches.files import FileStore
from sluicegate.batches.lines import InputFileError, numbered_lines, parse_line
from sluicegate.batches.store import LineOutcome

#: A request naming a LoRA adapter or a route -> one for its base model + adapter, or for the route's version; may
#: raise ``ApiError`` (the line's refusal).
Route = Callable[[InferenceRequest], InferenceRequest]


class LineTools(BaseModel):
    """How a chat line's output is read for tool calls (its ``tools`` and ``tool_choice``), kept so the output
    file's body has the ``tool_calls`` the online API would answer with."""

    model_config = ConfigDict(extra="forbid")

    mode: Mode
    named: str | None = None
    tool_names: list[str]

    @classmethod
    def of(cls, plan: ToolPlan) -> LineTools | None:
        """None for a line without tools (its output is content)."""
        if plan.mode == "content":
            return None
        return cls(mode=plan.mode, named=plan.named, tool_names=sorted(plan.tool_names))

    def plan(self, fmt: ToolCallFormat | None) -> ToolPlan:
        """The plan again, with the tool-call format the model's workers advertise (None: try each format)."""
        return ToolPlan(self.mode, self.named, frozenset(self.tool_names), fmt)


class PreparedLine(BaseModel):
    """One line of the prepared file: its number, its custom_id, its request (None for an error line), and how
    its output is read for tool calls (None: content only)."""

    model_config = ConfigDict(extra="forbid")

    line: int
    custom_id: str
    request: InferenceRequest | None = None
    tools: LineTools | None = None
    # An embeddings line: how its vector is written (float or base64).
    encoding_format: Literal["float", "base64"] | None = None


@dataclass
class BuiltLine:
    """A line's pipeline request and how its output is read."""

    request: InferenceRequest
    tools: LineTools | None = None
    encoding_format: Literal["float", "base64"] | None = None


class Chunk(BaseModel):
    """A run of prepared lines published together: byte range in the prepared file and how many requests."""

    model_config = ConfigDict(extra="forbid")

    start: int
    end: int
    requests: int


@dataclass
class Prepared:
    """What validation produced."""

    total: int = 0
    chunks: list[Chunk] = field(default_factory=list)
    errors: list[tuple[int, LineOutcome]] = field(default_factory=list)
    models: set[str] = field(default_factory=set)


def prepared_path(store: FileStore, batch_id: str) -> str:
    """Where a batch's prepared requests live."""
    return store.path_for(f"{batch_id}.prepared")


def _refusal(exc: ApiError) -> LineOutcome:
    return LineOutcome(status_code=exc.status, code=exc.code or "invalid_request", message=exc.message, param=exc.param)


def build_line(
    body: dict[str, Any],
    *,
    endpoint: str,
    request_id: str,
    tenant: str,
    limits: Limits,
    deadline: datetime,
    known_models: set[str] | None,
    route: Route | None = None,
    trace: TraceContext | None = None,
    key_id: str | None = None,
    contexts: Mapping[str, int] | None = None,
) -> BuiltLine | LineOutcome:
    """The pipeline request for one line's body (and its tool plan), or the error the online API would have
    answered. ``contexts``: each model's context length as its live workers report it, which ``max_tokens`` must
    fit in, as online."""
    if endpoint == "/v1/embeddings":
        return _build_embedding_line(
            body,
            request_id=request_id,
            tenant=tenant,
            limits=limits,
            deadline=deadline,
            known_models=known_models,
            route=route,
            trace=trace,
            key_id=key_id,
        )
    model = ChatCompletionBody if endpoint == "/v1/chat/completions" else CompletionBody
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        return _refusal(invalid(exc, root_field="messages" if model is ChatCompletionBody else "prompt"))
    if parsed.stream:
        return LineOutcome(
            status_code=400, code="unsupported_parameter", message="stream is not supported in a batch", param="stream"
        )
    if parsed.deadline is not None:
        message = "a batch line's deadline is the end of its batch's completion window"
        return LineOutcome(status_code=400, code="unsupported_parameter", message=message, param="deadline")
    try:
        check_prompt_tokens(parsed, limits)
        max_tokens = checked_max_tokens(parsed, limits)
        request = build_request(
            parsed,
            request_id=request_id,
            tenant=tenant,
            tier="batch",
            trace=trace,
            max_tokens=max_tokens,
            # A line not started by the end of the window is not started at all.
            default_deadline=deadline,
            key_id=key_id,
        )
        # A line naming a LoRA adapter goes to its base model with the adapter set, and a line naming a route to
        # the version the route chooses (router.route_table, as online), which then has to be known, as the
        # online API checks the version it routed to.
        request = route(request) if route is not None else request
        fitted = check_context(parsed, max_tokens, (contexts or {}).get(request.model))
    except ApiError as exc:
        return _refusal(exc)
    except ValidationError as exc:
        return _refusal(invalid(exc))
    if known_models is not None and request.model not in known_models:
        return _unknown_model(request.model)
    if fitted != max_tokens:  # a default above the context, lowered to it
        request = request.model_copy(update={"sampling": request.sampling.model_copy(update={"max_tokens": fitted})})
    tools = (
        LineTools.of(plan_for(parsed.tools, parsed.tool_choice, None))
        if isinstance(parsed, ChatCompletionBody)
        else None
    )
    return BuiltLine(request, tools)


def _build_embedding_line(
    body: dict[str, Any],
    *,
    request_id: str,
    tenant: str,
    limits: Limits,
    deadline: datetime,
    known_models: set[str] | None,
    route: Route | None,
    trace: TraceContext | None,
    key_id: str | None,
) -> BuiltLine | LineOutcome:
    """An embeddings line: one input (a line is one request; a list of several is refused), built as the online
    API builds each input."""
    try:
        parsed = EmbeddingBody.model_validate(body)
    except ValidationError as exc:
        return _refusal(invalid(exc, root_field="input"))
    items = parsed.items()
    if len(items) != 1:
        return LineOutcome(
            status_code=400,
            code="unsupported_parameter",
            message=f"A batch line embeds one input, this one has {len(items)}: give each input a line of its own.",
            param="input",
        )
    item: EmbeddingInput = items[0]
    try:
        check_prompt_tokens(item, limits)
        request = build_request(
            item,
            request_id=request_id,
            tenant=tenant,
            tier="batch",
            trace=trace,
            max_tokens=1,
            default_deadline=deadline,
            key_id=key_id,
        )
        request = route(request) if route is not None else request
    except ApiError as exc:
        return _refusal(exc)
    except ValidationError as exc:
        return _refusal(invalid(exc))
    if known_models is not None and request.model not in known_models:
        return _unknown_model(request.model)
    return BuiltLine(request, encoding_format=parsed.encoding_format)


def _unknown_model(model: str) -> LineOutcome:
    return LineOutcome(
        status_code=404,
        code="model_not_found",
        message=f"The model '{model}' does not exist or has never had a live worker.",
        param="model",
    )


def prepare(
    store: FileStore,
    *,
    batch_id: str,
    input_path: str,
    endpoint: str,
    tenant: str,
    limits: Limits,
    expires_at: int,
    chunk_size: int,
    max_lines: int,
    known_models: set[str] | None,
    route: Route | None = None,
    trace: TraceContext | None = None,
    key_id: str | None = None,
    contexts: Mapping[str, int] | None = None,
) -> Prepared:
    """Validate the input file and write the prepared file. Blocking (run it in a thread). ``trace``: the
    context every line's request carries (the batch's validation, so a line's spans join the batch's trace).

    Raises :class:`InputFileError` for a file that is not a valid batch file.
    """
    deadline = datetime.fromtimestamp(expires_at, UTC)
    result = Prepared()
    seen: dict[str, int] = {}
    in_chunk = 0
    chunk_start = 0
    with store.open_read(input_path) as source, store.open_write(prepared_path(store, batch_id)) as out:
        position = 0
        for number, raw in numbered_lines(source):
            result.total += 1
            if result.total > max_lines:
                raise InputFileError(f"The file has more than {max_lines} lines.", code="too_many_lines", line=number)
            line = parse_line(raw, number)
            if line.url != endpoint:
                raise InputFileError(
                    f"Line {number}: url {line.url!r} differs from the batch's endpoint {endpoint!r}.",
                    code="mismatched_endpoint",
                    line=number,
                )
            if line.custom_id in seen:
                raise InputFileError(
                    f"Line {number}: custom_id {line.custom_id!r} is already used on line {seen[line.custom_id]}.",
                    code="duplicate_custom_id",
                    line=number,
                )
            seen[line.custom_id] = number
            built = build_line(
                line.body,
                endpoint=endpoint,
                request_id=batch_request_id(batch_id, number),
                tenant=tenant,
                limits=limits,
                deadline=deadline,
                known_models=known_models,
                route=route,
                trace=trace,
                key_id=key_id,
                contexts=contexts,
            )
            if isinstance(built, LineOutcome):
                result.errors.append((number, built))
                prepared = PreparedLine(line=number, custom_id=line.custom_id)
            else:
                result.models.add(built.request.model)
                prepared = PreparedLine(
                    line=number,
                    custom_id=line.custom_id,
                    request=built.request,
                    tools=built.tools,
                    encoding_format=built.encoding_format,
                )
            request = prepared.request
            data = prepared.model_dump_json().encode()
            out.write(data + b"\n")
            position += len(data) + 1
            if request is not None:
                in_chunk += 1
                if in_chunk == chunk_size:
                    result.chunks.append(Chunk(start=chunk_start, end=position, requests=in_chunk))
                    chunk_start, in_chunk = position, 0
        if in_chunk:
            result.chunks.append(Chunk(start=chunk_start, end=position, requests=in_chunk))
    if result.total == 0:
        raise InputFileError("The file holds no requests.", code="empty_file")
    return result


def read_prepared(store: FileStore, batch_id: str, start: int = 0, end: int | None = None) -> list[PreparedLine]:
    """Prepared lines in the byte range [start, end) (the whole file by default). Blocking."""
    with store.open_read(prepared_path(store, batch_id)) as handle:
        handle.seek(start)
        data = handle.read() if end is None else handle.read(end - start)
    return [PreparedLine.model_validate_json(raw) for raw in data.splitlines() if raw.strip()]


def chunks_json(chunks: list[Chunk]) -> str:
    """The chunk list as kept in the batch hash."""
    return json.dumps([c.model_dump() for c in chunks])


def chunks_from_json(raw: str | None) -> list[Chunk]:
    """Inverse of :func:`chunks_json`."""
    return [Chunk.model_validate(c) for c in json.loads(raw)] if raw else []
