"""Ingress: the settings of the HTTP API process, composed of the concerns it reads plus its own fields (where it
binds, its Kafka producers, request timeouts, the response cache and the Responses API)."""

from __future__ import annotations

from pydantic import Field

from .admission import AdmissionSettings
from .backbone import BackboneSettings
from .batch_api import BatchApiSettings
from .fleet import FleetSettings
from .public_api import PublicApiSettings
from .routing import RoutingSettings
from .telemetry import TelemetrySettings
from .usage import TenantQuotaSettings


class IngressSettings(
    RoutingSettings,
    BatchApiSettings,
    BackboneSettings,
    TelemetrySettings,
    FleetSettings,
    PublicApiSettings,
    TenantQuotaSettings,
    AdmissionSettings,
):
    """What an ingress process reads: no engine, worker, router-process or batch-worker fields."""

    ingress_host: str = Field("0.0.0.0", description="Address the ingress API binds to.")
    ingress_count_prompt_tokens: bool = Field(
        True,
        description="Count each prompt with the tokenizer its workers publish and refuse prompt + max_tokens over "
        "the context at once (400); false leaves that check to the worker (an error event in the stream).",
    )
    ingress_producers: int = Field(
        2,
        ge=1,
        le=16,
        description="Kafka producers one ingress process publishes through. Each has one produce request in "
        "flight at a time, so a publish handed to a busy one waits for the previous acknowledgement.",
    )
    ingress_redis_timeout_s: float = Field(
        3.0,
        gt=0,
        description="Longest ingress waits for one Redis command before a 503 (a Redis that hangs answers nothing; "
        "not retried, unlike a refused connection).",
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Longest an OpenAI-style call waits for its result before it is cancelled."
    )
    lora_check_timeout_s: float = Field(
        15.0,
        gt=0,
        description="Longest `POST /v1/load_lora_adapter` waits for a live worker of the base model to verify the "
        "adapter's files before it answers 503.",
    )

    # --- response cache ----------------------------------------------------------------------------------------
    response_cache_ttl_s: int = Field(
        0,
        ge=0,
        description="Seconds a deterministic request's reply (temperature 0, or a seed) is kept in Redis and "
        "replayed to an identical request; 0 turns the response cache off.",
    )
    response_cache_shared: bool = Field(
        False, description="Share cached replies across tenants (by default each tenant has its own)."
    )
    response_cache_max_bytes: int = Field(
        1_000_000, ge=1024, description="Largest reply (its stream events, JSON) the response cache keeps."
    )

    # --- Responses API -----------------------------------------------------------------------------------------
    responses_ttl_s: int = Field(
        30 * 86400,
        ge=60,
        description="Seconds a stored response (store: true: its input, output and conversation, which "
        "previous_response_id continues) is kept in Redis after it is created; the event stream it can be "
        "replayed from is kept SLUICEGATE_STREAM_TTL_S after the response ends.",
    )
    responses_sweep_s: float = Field(
        5.0,
        gt=0,
        description="How often one ingress (a Redis lock elects it) saves the final object of stored responses "
        "that ended with no client reading them (background ones), before their event stream expires.",
    )
