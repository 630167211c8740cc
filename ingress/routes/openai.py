"""The OpenAI-compatible endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (the whole
answer, or server-sent events with ``stream``; a completion's list of prompts in
:mod:`ingress.multi_prompt_completions`), and the model listing ``GET /v1/models[/{model}]`` (models with a live
worker, the routed public names one of whose versions has one, and the LoRA adapters the caller's tenant may use
whose base model is listed, with ``parent`` = that base as vLLM shows them)."""

from __future__ import annotations

import time
from typing import Annotated, Any
from urllib.parse import urlsplit, urlunsplit

from fastapi import APIRouter, Path, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from schemas import LoRAAdapter
from sluicegate.api.bodies import SEVERAL_PROMPTS, ChatCompletionBody, CompletionBody
from sluicegate.api.errors import ApiError
from sluicegate.api.openai_choices import ChoicePlan, whole_choices
from sluicegate.api.openai_format import Kind, ResponseIds
from sluicegate.api.reasoning import reasoning_plan
from sluicegate.api.tool_calls import ToolPlan, plan_for

from ..accept import SUBMIT_ERRORS, accept, answered_model, rate_headers
from ..app_state import service_of
from ..auth import ApiKey, Caller, authenticate
from ..body_parsing import parse_body
from ..errors import answered_under
from ..multi_prompt_completions import answer_prompts
from ..openai_stream import body_events, collect_or_cancel, stream_failure
from ..openapi import ChatCompletion, ModelCard, ModelList, TextCompletion, errors, json_body, ok
from ..route_without_dependencies import lean_post

router = APIRouter(tags=["openai"])

# Statuses of waiting for a request's result, on top of accepting it.
_RESULT_ERRORS = (409, 500, 504)


async def _answer(request: Request, caller: ApiKey, body: ChatCompletionBody | CompletionBody, kind: Kind) -> Response:
    """Accept the request, then answer it as a stream of events or as one response."""
    accepted_at = time.perf_counter()
    accepted = await accept(request, caller, body, f"/v1/{'chat/' if kind == 'chat' else ''}completions")
    inference = accepted.inference
    with answered_under(inference.request_id):  # a worker's failure, a timeout: answered under the request's id
        ids = ResponseIds(kind, inference.request_id, answered_model(inference), int(time.time()))
        service = service_of(request)
        chat = isinstance(body, ChatCompletionBody)
        plan = ChoicePlan(
            kind,
            n=inference.sampling.n,
            logprobs=inference.sampling.logprobs is not None,
            tools=plan_for(body.tools, body.tool_choice, accepted.tool_call_format) if chat else ToolPlan(),
            reasoning=await reasoning_plan(service.tokenizers, inference, accepted.reasoning_parser) if chat else None,
        )
        headers = {"x-request-id": inference.request_id} | rate_headers(accepted)
        if body.stream:
            stream = body_events(request, ids, body, accepted, plan=plan, accepted_at=accepted_at)
            headers |= {"cache-control": "no-cache", "x-accel-buffering": "no"}
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        assembler = await collect_or_cancel(request, service, inference.request_id, inference.tenant)
        if assembler is None:
            # The client left; nobody reads this, 499 is for logs and metrics.
            return Response(status_code=499)
        failure = stream_failure(assembler)
        if failure is not None:
            raise failure
        assert assembler.done is not None
        payload = ids.choices_response(whole_choices(assembler, plan), assembler.done.usage)
        return JSONResponse(payload, headers=headers)


@lean_post(
    router,
    "/v1/chat/completions",
    openapi_extra=json_body(ChatCompletionBody),
    responses=ok(ChatCompletion, stream=True) | errors(*SUBMIT_ERRORS, *_RESULT_ERRORS),
)
async def chat_completions(request: Request) -> Response:
    caller = await authenticate(request)
    body = await parse_body(request, ChatCompletionBody, root_field="messages")
    return await _answer(request, caller, body, "chat")


@lean_post(
    router,
    "/v1/completions",
    openapi_extra=json_body(CompletionBody),
    responses=ok(TextCompletion, stream=True) | errors(*SUBMIT_ERRORS, *_RESULT_ERRORS),
)
async def completions(request: Request) -> Response:
    caller = await authenticate(request)
    body = await parse_body(request, CompletionBody, root_field="prompt", context=SEVERAL_PROMPTS)
    if len(body.prompts()) > 1:
        return await answer_prompts(request, caller, body)
    return await _answer(request, caller, body, "completion")


async def _listed(request: Request) -> dict[str, list[Any]]:
    """Models with a live worker, and the routed public names with a live version (their versions' beats)."""
    service = service_of(request)
    models = await service.live_models()
    for name, spec in service.routes.routes.routes.items():
        beats = [b for version in spec.versions if version in models for b in models[version]]
        if beats and name not in models:
            models[name] = beats
    return models


async def _cards(request: Request, caller: ApiKey) -> dict[str, dict[str, Any]]:
    """Every model card the caller sees, by id: the listed models, then the adapters of listed base models."""
    models = await _listed(request)
    cards = {name: _model_card(name, beats) for name, beats in models.items()}
    for adapter in await service_of(request).adapters.visible(caller.tenant):
        if adapter.base_model in models and adapter.name not in cards:
            cards[adapter.name] = _adapter_card(adapter, models[adapter.base_model])
    return cards


@router.get("/v1/models", responses=ok(ModelList) | errors(401, 503))
async def list_models(request: Request, caller: Caller) -> dict[str, Any]:
    return {"object": "list", "data": list((await _cards(request, caller)).values())}


# A model's name has no control characters; the route's pattern would not even match one with a line feed.
ModelPath = Annotated[str, Path(json_schema_extra={"pattern": r"^[^\x00-\x1f\x7f]+$"})]


@router.get("/v1/models/{model:path}", responses=ok(ModelCard) | errors(401, 404, 503))
async def get_model(request: Request, caller: Caller, model: ModelPath) -> dict[str, Any]:
    card = (await _cards(request, caller)).get(model)
    if card is None:
        raise ApiError(
            404, f"The model '{model}' does not exist or has no live worker.", code="model_not_found", param="model"
        )
    return card


def _model_card(name: str, beats: list[Any]) -> dict[str, Any]:
    """The OpenAI model object, plus ``workers`` and (when a worker says them) ``description``, such as that its
    weights are random, and ``architecture`` (e.g. Qwen3ForCausalLM): extra fields that OpenAI's SDKs keep as
    they are."""
    created = min((int(b.sent_at.timestamp()) for b in beats), default=int(time.time()))
    card = {"id": name, "object": "model", "created": created, "owned_by": "sluicegate", "workers": len(beats)}
    description = next((b.description for b in beats if b.description), None)
    if description:
        card["description"] = description
    architecture = next((b.architecture for b in beats if b.architecture), None)
    if architecture:
        card["architecture"] = architecture
    # Whether an answer is reproducible depends on which worker takes the request: a fleet that mixes modes says so.
    deterministic = sum(b.deterministic for b in beats)
    card["deterministic"] = bool(beats) and deterministic == len(beats)
    card["deterministic_workers"] = deterministic
    arithmetics = sorted({b.arithmetic for b in beats if b.deterministic and b.arithmetic})
    if 0 < deterministic < len(beats):
        card["warning"] = (
            f"{deterministic} of {len(beats)} workers run deterministic (SLUICEGATE_DETERMINISTIC): "
            "a request's answer depends on which worker serves it"
        )
    elif len(arithmetics) > 1:
        card["warning"] = (
            f"the deterministic workers compute differently ({'; '.join(arithmetics)}): "
            "a request's answer depends on which worker serves it"
        )
    return card


def _adapter_card(adapter: LoRAAdapter, beats: list[Any]) -> dict[str, Any]:
    """An adapter as vLLM lists one: ``parent`` its base model, ``root`` its files (a URL's credentials left out);
    ``workers`` are its base model's that serve adapters (any of them loads it on demand)."""
    return {
        "id": adapter.name,
        "object": "model",
        "created": int(adapter.created_at.timestamp()),
        "owned_by": "sluicegate",
        "workers": sum(b.serves_adapters for b in beats),
        "root": _without_credentials(adapter.path),
        "parent": adapter.base_model,
    }


def _without_credentials(path: str) -> str:
    """``path`` with any ``user:password@`` of a URL removed (an fsspec URL may carry them; cards are public)."""
    parts = urlsplit(path)
    if not parts.scheme or "@" not in parts.netloc:
        return path
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
