"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: a prompt or chat messages to token ids (with the count
and the model's context length), and token ids back to text, with the tokenizer the model's workers publish (a
LoRA adapter's name uses its base model's: an adapter does not change the tokenizer)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from sluicegate.api.errors import ApiError
from sluicegate.api.limits import model_context
from sluicegate.api.prompt_tokens import ModelTokenizerView

from ..app_state import service_of
from ..auth import ApiKey, authenticate
from ..body_parsing import parse_body
from ..openapi import errors, json_body, ok
from ..tokenize_bodies import DetokenizeBody, DetokenizeResponse, TokenizeBody, TokenizeResponse

router = APIRouter(tags=["tokenize"])


async def _tokenizer(request: Request, caller: ApiKey, model: str) -> tuple[ModelTokenizerView, int | None]:
    service = service_of(request)
    model = (await service.adapters.resolve(model, tenant=caller.tenant)).model
    heartbeats = await service.model_heartbeats(model)  # 404 for a model nobody serves
    view = await service.tokenizers.get(model)
    if view is None:
        raise ApiError(
            503, f"No worker of model {model!r} has published its tokenizer yet.", code="tokenizer_unavailable"
        )
    return view, model_context(heartbeats) or view.published.max_model_len


@router.post(
    "/tokenize",
    openapi_extra=json_body(TokenizeBody),
    responses=ok(TokenizeResponse) | errors(400, 401, 404, 503),
)
async def tokenize(request: Request) -> dict[str, Any]:
    caller = await authenticate(request)
    body = await parse_body(request, TokenizeBody, root_field="prompt")
    view, context = await _tokenizer(request, caller, body.model)
    try:
        if body.messages is not None:
            tokens = view.encode_messages(body.chat_messages(), body.tools, body.add_generation_prompt)
        else:
            tokens = view.encode_text(body.prompt or "", body.add_special_tokens)
    except Exception as exc:  # the template's own refusal, or no template
        raise ApiError(
            400, f"Cannot render these messages: {exc}", code="chat_template_error", param="messages"
        ) from exc
    return {"count": len(tokens), "max_model_len": context, "tokens": tokens}


@router.post(
    "/detokenize",
    openapi_extra=json_body(DetokenizeBody),
    responses=ok(DetokenizeResponse) | errors(400, 401, 404, 503),
)
async def detokenize(request: Request) -> dict[str, Any]:
    caller = await authenticate(request)
    body = await parse_body(request, DetokenizeBody, root_field="tokens")
    view, _ = await _tokenizer(request, caller, body.model)
    view.check_in_vocabulary(body.tokens, param="tokens")
    return {"prompt": view.decode(body.tokens)}
