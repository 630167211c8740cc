"""LoRA adapters at run time, under vLLM's names and bodies: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``, for admin keys only (the router's dependency).

A load is verified before it is registered: a live worker of the base model reads the files against the real
model (``sluicegate.lora.checks``; ingress has no model), a refusal is a 400 with the worker's one-line reason
and no worker answering a 503. The registry (``sluicegate.lora.registry``) then makes the adapter a model name
for every ingress, router and batch worker (within their cache TTL; this process at once).

Where we differ from vLLM, on purpose: a name already registered is a 409 ``adapter_exists`` (vLLM answers 400);
the body may name the ``base_model`` (required when more than one model is served) and a ``tenant`` the adapter
is private to. Success answers vLLM's plain-text sentence.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas import AdapterName
from sluicegate.api.errors import ApiError
from sluicegate.api.schema_rules import any_of, given, rules
from sluicegate.lora.checks import NoCheckerError, ask_check
from sluicegate.lora.registry import AdapterExistsError

from ..app_state import service_of
from ..auth import require_admin
from ..openapi import errors, plain_text
from ..service import IngressService

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["adapters"], dependencies=[Depends(require_admin)])


class LoadLoRAAdapterBody(BaseModel):
    """vLLM's load body, plus the base model and the tenant the adapter is private to."""

    model_config = ConfigDict(extra="forbid")

    lora_name: AdapterName
    lora_path: str = Field(
        min_length=1, max_length=4096, description="A local directory or fsspec URL every worker can read."
    )
    base_model: str | None = Field(
        None, min_length=1, max_length=256, description="The served model it applies to (default: the only one)."
    )
    tenant: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9._:@-]+$",
        description="Make the adapter private to this tenant (default: every tenant sees it).",
    )


class UnloadLoRAAdapterBody(BaseModel):
    """vLLM's unload body: the adapter's name (or its integer id)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=rules(any_of(given("lora_name"), given("lora_int_id"))))

    lora_name: AdapterName | None = None
    lora_int_id: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_given(self) -> UnloadLoRAAdapterBody:
        if self.lora_name is None and self.lora_int_id is None:
            raise ValueError("give 'lora_name' (or 'lora_int_id')")
        return self


async def _base_model(service: IngressService, asked: str | None) -> str:
    """The base model the adapter is for: the one asked for, which must be served, or the only served one."""
    served = set(await service.live_models()) | service.served_models
    if asked is not None:
        if asked not in served:
            raise ApiError(
                404,
                f"The model '{asked}' does not exist or has no live worker.",
                code="model_not_found",
                param="base_model",
            )
        return asked
    if not served:
        raise ApiError(404, "No model is served, so there is no base model for the adapter.", code="model_not_found")
    if len(served) > 1:
        listed = ", ".join(sorted(served))
        raise ApiError(400, f"'base_model' is required: several models are served ({listed}).", param="base_model")
    return next(iter(served))


@router.post(
    "/load_lora_adapter",
    # Response, not PlainTextResponse: the route's class decides the documented type of its error bodies (JSON).
    response_class=Response,
    responses=plain_text("The adapter was verified and registered.") | errors(400, 401, 403, 404, 409, 503),
)
async def load_lora_adapter(request: Request, body: LoadLoRAAdapterBody) -> PlainTextResponse:
    service = service_of(request)
    name = body.lora_name
    base = await _base_model(service, body.base_model)
    # An adapter named like a model (or a routed name) would hide it, or be hidden: refused, not guessed.
    if name in service.served_models or name in service.routes.routes.routes or await service.heartbeats.get(name):
        raise ApiError(400, f"'{name}' is already a model name; give the adapter another.", param="lora_name")
    if await service.lora_registry.get(name) is not None:
        raise AdapterExistsError(name)  # before asking a worker: the answer could not change this
    beats = await service.heartbeats.get(base)
    if beats and not any(b.serves_adapters for b in beats):
        # Said at once: no worker would take the check, and the wait would end in a 503 that does not say why.
        raise ApiError(
            400,
            f"No live worker of '{base}' serves LoRA adapters: start its workers with SLUICEGATE_ENABLE_LORA=true "
            "(or name adapters with --lora). Nothing was registered.",
            code="lora_not_enabled",
            param="base_model",
        )
    try:
        verdict = await ask_check(
            service.redis,
            service.settings.topic_prefix,
            base,
            name,
            body.lora_path,
            timeout=service.settings.lora_check_timeout_s,
        )
    except NoCheckerError as exc:
        raise ApiError(
            503, f"{exc}; nothing was registered.", code="service_unavailable", headers={"Retry-After": "5"}
        ) from exc
    if not verdict.ok:
        raise ApiError(
            400, f"LoRA adapter '{name}' refused: {verdict.reason}", code="invalid_lora_adapter", param="lora_path"
        )
    adapter = await service.lora_registry.register(name, base, body.lora_path, tenant=body.tenant, rank=verdict.rank)
    service.adapters.invalidate()
    log.info(
        "ingress.lora_loaded name=%s base_model=%s lora_int_id=%s rank=%s tenant=%s",
        name,
        base,
        adapter.lora_int_id,
        adapter.rank,
        adapter.tenant or "-",
    )
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post(
    "/unload_lora_adapter",
    response_class=Response,
    responses=plain_text("The adapter was removed from the registry.") | errors(400, 401, 403, 404, 503),
)
async def unload_lora_adapter(request: Request, body: UnloadLoRAAdapterBody) -> PlainTextResponse:
    service = service_of(request)
    name = body.lora_name
    if name is None:  # by id: vLLM's older form
        found = [a for a in await service.lora_registry.list() if a.lora_int_id == body.lora_int_id]
        name = found[0].name if found else None
    elif body.lora_int_id is not None:
        adapter = await service.lora_registry.get(name)
        name = name if adapter is not None and adapter.lora_int_id == body.lora_int_id else None
    if name is None or not await service.lora_registry.unregister(name):
        what = f"'{body.lora_name}'" if body.lora_name else f"with id {body.lora_int_id}"
        raise ApiError(404, f"The lora adapter {what} cannot be found.", code="adapter_not_found", param="lora_name")
    service.adapters.invalidate()
    log.info("ingress.lora_unloaded name=%s", name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
