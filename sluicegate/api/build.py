"""The pipeline's :class:`schemas.InferenceRequest` from a checked body (``build_request``), as ingress builds it for
a request it accepts and the batch service for each line of a batch; and the tool-call format a model's workers
advertise, by which both read tool calls from a finished output."""

from __future__ import annotations

from datetime import datetime

from schemas import (
    ChatMessage,
    InferenceRequest,
    Pooling,
    Task,
    Tier,
    ToolCallFormat,
    TraceContext,
    WorkerHeartbeat,
    utcnow,
)

from .bodies import AnyBody, ChatCompletionBody, CompletionBody, EmbeddingInput, NativeRequestBody


def advertised_tool_call_format(heartbeats: list[WorkerHeartbeat]) -> ToolCallFormat | None:
    """The one tool-call format a model's workers advertise (None when none or they disagree)."""
    formats = {b.tool_call_format for b in heartbeats if b.tool_call_format}
    return formats.pop() if len(formats) == 1 else None


def build_request(
    body: AnyBody,
    *,
    request_id: str,
    tenant: str,
    tier: Tier,
    trace: TraceContext | None,
    now: datetime | None = None,
    max_tokens: int | None = None,
    default_deadline: datetime | None = None,
    key_id: str | None = None,
    adapter: str | None = None,
    reader: str | None = None,
) -> InferenceRequest:
    """The pipeline request for a validated body; ``ValueError`` for a deadline already passed.

    ``max_tokens`` replaces the body's (already checked against the key's cap); ``default_deadline`` applies
    when the body gives no deadline (the key's queue-time budget); ``key_id`` names the caller's API key (the
    usage ledger's); ``adapter`` the LoRA adapter the body's model name resolved to (``sluicegate.lora.resolve``:
    the body's ``model`` is then already its base model); ``reader`` the ingress instance relaying the output to a
    client that cannot resume it (``InferenceRequest.reader``).
    """
    now = now or utcnow()
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    tools = None
    template_kwargs = None
    task: Task = "generate"
    pooling: Pooling | None = None
    if isinstance(body, ChatCompletionBody):
        messages = body.chat_messages()
        tools = body.offered_tools()
        template_kwargs = body.chat_template_kwargs
    elif isinstance(body, CompletionBody):
        prompt = body.prompt  # type: ignore[assignment]  # narrowed to one prompt by its validator
    elif isinstance(body, EmbeddingInput):
        prompt = body.prompt
        task, pooling = "embed", body.pooling
    else:
        assert isinstance(body, NativeRequestBody)
        prompt = body.prompt
        tools = body.tools
        messages = [m.to_schema() for m in body.messages] if body.messages else None
    deadline = body.absolute_deadline(now)
    if deadline is not None and deadline <= now:
        raise ValueError(f"deadline {deadline.isoformat()} has already passed")
    if deadline is None:
        deadline = default_deadline
    return InferenceRequest(
        request_id=request_id,
        model=body.model,
        prompt=prompt,
        messages=messages,
        sampling=body.sampling(max_tokens if max_tokens is not None else body.resolved_max_tokens()),
        guided=body.guided_spec(),
        tools=tools or None,
        chat_template_kwargs=template_kwargs or None,
        priority=tier,
        tenant=tenant,
        key_id=key_id,
        user=getattr(body, "user", None),
        deadline=deadline,
        created_at=now,
        trace=trace,
        task=task,
        pooling=pooling,
        adapter=adapter,
        reader=reader,
    )
