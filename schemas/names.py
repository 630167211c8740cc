"""Every Kafka topic and Redis key name Sluicegate uses, in one place.

Services and tests build names only through :class:`Names`, so a deployment (or a test) can isolate
itself with a prefix and no topic or key string is spelled anywhere else.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Literal

Tier = Literal["interactive", "standard", "batch"]
#: The one tier order: most urgent first, the order a worker drains them and the engine schedules them.
TIERS: tuple[Tier, ...] = ("interactive", "standard", "batch")


def tier_rank(tier: str) -> int:
    """A tier's place in :data:`TIERS` (0 = interactive = served first); ``ValueError`` naming the valid ones.

    This is also the engine's integer priority (lower runs first, as in vLLM), so a tier means the same
    thing at ingress, in the router, in the worker's fetch order and in the engine's scheduler.
    """
    try:
        return TIERS.index(tier)  # type: ignore[arg-type]
    except ValueError:
        raise ValueError(f"unknown tier {tier!r}; expected one of {', '.join(TIERS)}") from None


_TOPIC_SAFE = re.compile(r"[^A-Za-z0-9._-]")
# Kafka caps topic names at 249 characters; keep room for prefix and tier.
_MAX_MODEL_TOKEN = 120


def model_token(model: str) -> str:
    """The model name as it appears inside topic names and keys.

    Characters Kafka does not allow in a topic (``/`` in hub ids, spaces...) become ``_``; when any
    were replaced, a short hash of the original keeps two different models from colliding.
    """
    if not model:
        raise ValueError("model name must not be empty")
    safe = _TOPIC_SAFE.sub("_", model)
    if safe != model or len(safe) > _MAX_MODEL_TOKEN:
        digest = hashlib.sha256(model.encode()).hexdigest()[:8]
        safe = f"{safe[: _MAX_MODEL_TOKEN - 9]}-{digest}"
    return safe


#: What a request's ``tenant`` may be (``InferenceRequest.tenant``); a tenant's token is drawn from it.
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")


def tenant_token(tenant: str) -> str:
    """The tenant as it appears inside topic names and keys (as :func:`model_token` does a model).

    The token never holds ``:`` (the key separator) nor a glob character, so the Redis ACL pattern
    ``llm:stream:<token>:*`` of one tenant matches no key of another; a tenant with ``:`` or ``@`` gets ``_`` and
    a short hash of its name instead. ``ValueError`` for a name no request may carry.
    """
    if not TENANT_PATTERN.match(tenant):
        raise ValueError(f"tenant {tenant!r} is not a tenant name ([A-Za-z0-9._:@-], 1 to 128 characters)")
    return model_token(tenant)


@dataclass(frozen=True)
class Names:
    """Topic and key names under an optional prefix (``SLUICEGATE_TOPIC_PREFIX``).

    ``tenants_apart`` (``SLUICEGATE_TENANT_TOPICS``) gives each tenant its own results, DLQ and control topic and
    puts the tenant into the keys its readers may see (stream, request record, cancel marker), so broker and Redis
    ACLs can keep tenants apart; the ``*_of`` methods and the keys then need the tenant, else they name the shared
    topic and key.
    """

    prefix: str = ""
    tenants_apart: bool = False

    # --- Kafka topics -----------------------------------------------------------------------
    @property
    def inbound_topic(self) -> str:
        """Where Kafka-native producers put requests for the router to validate and route."""
        return f"{self.prefix}llm.inbound"

    def tenant_inbound_topic(self, tenant: str) -> str:
        """A tenant's own inbound topic, ``llm.inbound.<tenant>`` (with tenants apart): the router takes the tenant
        of a record from the topic it came on, so only the tenant's principal may write there."""
        return f"{self.inbound_topic}.{tenant_token(tenant)}"

    def request_topic(self, model: str, tier: Tier) -> str:
        """The topic workers serving ``model`` consume for ``tier``: ``llm.<model>.<tier>``."""
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; expected one of {', '.join(TIERS)}")
        return f"{self.prefix}llm.{model_token(model)}.{tier}"

    def request_topics(self, model: str) -> list[str]:
        """All of a model's request topics, highest tier first."""
        return [self.request_topic(model, tier) for tier in TIERS]

    @property
    def results_topic(self) -> str:
        """Durable final results, for batch collectors and audit."""
        return f"{self.prefix}llm.results"

    def results_topic_of(self, tenant: str) -> str:
        """Where ``tenant``'s final results go: ``llm.results.<tenant>`` with tenants apart, else ``llm.results``."""
        return f"{self.results_topic}.{tenant_token(tenant)}" if self.tenants_apart else self.results_topic

    @property
    def dlq_topic(self) -> str:
        """Messages that could not be routed or served, with a ``reason`` header."""
        return f"{self.prefix}llm.dlq"

    def dlq_topic_of(self, tenant: str | None) -> str:
        """Where ``tenant``'s dead letters go: ``llm.dlq.<tenant>`` with tenants apart (its prompts are its own),
        else ``llm.dlq``; a record whose tenant cannot be told (unreadable) goes to the shared one."""
        if self.tenants_apart and tenant is not None:
            return f"{self.dlq_topic}.{tenant_token(tenant)}"
        return self.dlq_topic

    @property
    def control_topic(self) -> str:
        """Cancellations fanned out to every worker."""
        return f"{self.prefix}llm.control"

    def control_topic_of(self, tenant: str) -> str:
        """Where cancels of ``tenant``'s requests go: ``llm.control.<tenant>`` with tenants apart (a worker takes
        the tenant from the topic and cancels only that tenant's requests), else ``llm.control``."""
        return f"{self.control_topic}.{tenant_token(tenant)}" if self.tenants_apart else self.control_topic

    @property
    def heartbeats_topic(self) -> str:
        """Worker heartbeats (also mirrored to Redis for quick lookups)."""
        return f"{self.prefix}llm.heartbeats"

    @property
    def kv_events_topic(self) -> str:
        """Workers' KV-cache events (``KVCacheEvents``), keyed by worker id: what a router routes prompts on."""
        return f"{self.prefix}llm.kv_events"

    @property
    def usage_topic(self) -> str:
        """The usage ledger: one ``UsageRecord`` per ended request, keyed by request id (at least once)."""
        return f"{self.prefix}llm.usage"

    def worker_group(self, model: str) -> str:
        """The consumer group of the workers serving ``model``."""
        return f"{self.prefix}sluicegate-workers.{model_token(model)}"

    # --- Redis keys -----------------------------------------------------------------------------
    def _of_tenant(self, kind: str, request_id: str, tenant: str | None) -> str:
        """``llm:<kind>:<tenant>:<request id>`` with tenants apart, else ``llm:<kind>:<request id>``."""
        if not self.tenants_apart:
            return f"{self.prefix}llm:{kind}:{request_id}"
        if tenant is None:
            raise ValueError(f"with tenants apart a {kind} key needs the request's tenant")
        return f"{self.prefix}llm:{kind}:{tenant_token(tenant)}:{request_id}"

    def stream_key(self, request_id: str, tenant: str | None = None) -> str:
        """The Redis stream of one request's events (``llm:stream:<tenant>:<id>`` with tenants apart)."""
        return self._of_tenant("stream", request_id, tenant)

    def tokenizer_key(self, model: str) -> str:
        """String with the ``ModelTokenizer`` JSON the model's workers publish (ingress counts prompts with it)."""
        return f"{self.prefix}llm:tokenizer:{model_token(model)}"

    def request_key(self, request_id: str, tenant: str | None = None) -> str:
        """Hash with a request's status, owner and final result (the tenant in it with tenants apart)."""
        return self._of_tenant("request", request_id, tenant)

    def epoch_key(self, request_id: str, tenant: str | None = None) -> str:
        """Integer: a request's owner epoch, raised by every worker that picks the request up; writes of an
        older epoch to its stream and record are refused (``gpu_workers.worker.fencing``)."""
        return self._of_tenant("epoch", request_id, tenant)

    def cancel_key(self, request_id: str, tenant: str | None = None) -> str:
        """Marker that a request was cancelled, honoured even if it is still queued in Kafka (the tenant in it
        with tenants apart)."""
        return self._of_tenant("cancel", request_id, tenant)

    def tenant_key_patterns(self, tenant: str) -> list[str]:
        """The Redis ACL key patterns (``~pattern``) of the keys a reader of ``tenant``'s own output may read: its
        streams, request records and cancel markers. Only with tenants apart do these keys carry the tenant."""
        if not self.tenants_apart:
            raise ValueError("tenant key patterns need tenants apart (SLUICEGATE_TENANT_TOPICS=true)")
        token = tenant_token(tenant)
        return [f"{self.prefix}llm:{kind}:{token}:*" for kind in ("stream", "request", "cancel")]

    def reader_key(self, reader: str) -> str:
        """Lease (a key with a TTL) of an ingress instance relaying output to clients that cannot resume it."""
        return f"{self.prefix}llm:reader:{reader}"

    def workers_key(self, model: str) -> str:
        """Hash of live workers' latest heartbeats for ``model``, field = worker id."""
        return f"{self.prefix}llm:workers:{model_token(model)}"

    @property
    def models_key(self) -> str:
        """Set of model names that have had a live worker."""
        return f"{self.prefix}llm:models"

    def response_cache_key(self, model: str, digest: str) -> str:
        """A cached reply (its stream events) of ``model`` for one request digest (tenant included unless shared)."""
        return f"{self.prefix}llm:reply-cache:{model_token(model)}:{digest}"

    def route_rollback_key(self, route: str, version: str) -> str:
        """A canary rolled back to weight 0 (JSON: the route spec's digest it applies to, cause, time)."""
        return f"{self.prefix}llm:route-rollback:{model_token(route)}:{model_token(version)}"

    def rate_key(self, key_id: str, window: str) -> str:
        """Counter for one API key's rate limit in one window."""
        return f"{self.prefix}llm:rate:{key_id}:{window}"

    # --- LoRA adapters ----------------------------------------------------------------------
    @property
    def lora_adapters_key(self) -> str:
        """Hash of the registered LoRA adapters: field = adapter name, value = ``LoRAAdapter`` JSON."""
        return f"{self.prefix}lora:adapters"

    @property
    def lora_next_id_key(self) -> str:
        """Counter the registry INCRs for each new adapter's ``lora_int_id``."""
        return f"{self.prefix}lora:next_id"

    def lora_checks_key(self, base_model: str) -> str:
        """List of pending adapter checks (JSON) that a live worker of ``base_model`` pops and answers."""
        return f"{self.prefix}lora:checks:{model_token(base_model)}"

    def lora_verdict_key(self, check_id: str) -> str:
        """List the worker pushes one check's verdict (JSON) onto; the asker BLPOPs it (TTL'd)."""
        return f"{self.prefix}lora:verdict:{check_id}"

    # --- Responses API ---------------------------------------------------------------------------
    def response_key(self, tenant: str, response_id: str) -> str:
        """Hash of one stored response of ``tenant``: its ``record`` (request, input items, conversation chain),
        its ``final`` response object once it ended, and ``cancel`` once a cancel was asked for."""
        return f"{self.prefix}llm:response:{tenant}:{response_id}"

    @property
    def responses_pending_key(self) -> str:
        """Sorted set of stored responses not yet final (``<tenant> <response id>``), scored by creation time."""
        return f"{self.prefix}llm:responses:pending"

    @property
    def responses_sweep_lock_key(self) -> str:
        """Lock held by the one ingress sweeping the pending responses in an interval."""
        return f"{self.prefix}llm:responses:sweep-lock"

    # --- usage ledger rollup and token quotas -----------------------------------------------------------
    def usage_seen_key(self, request_id: str) -> str:
        """Marker that the rollup counted a request's usage record (the ledger's de-duplication, with a TTL)."""
        return f"{self.prefix}llm:usage:seen:{request_id}"

    def usage_bucket_key(self, tenant: str, hour: int) -> str:
        """Hash of a tenant's usage in one hour (``hour`` = unix seconds // 3600): field = group, metric."""
        return f"{self.prefix}llm:usage:{tenant}:h:{hour}"

    def usage_hours_key(self, tenant: str) -> str:
        """Sorted set of the hours a tenant has usage in (member and score: the hour)."""
        return f"{self.prefix}llm:usage:{tenant}:hours"

    def quota_counter_key(self, scope: str, owner: str, period: str) -> str:
        """Tokens used or reserved by one key or tenant (``scope``) in one period (``d20250101``, ``m202501``)."""
        return f"{self.prefix}llm:quota:{scope}:{owner}:{period}"

    def quota_hold_key(self, request_id: str) -> str:
        """Hash of a request's quota reservation: tokens reserved, the counters charged, and once settled."""
        return f"{self.prefix}llm:quota:hold:{request_id}"

    # --- Files and Batches API (Redis keys and the Celery queue) ----------------------------------
    def file_key(self, file_id: str) -> str:
        """JSON of one stored file's metadata (owner, storage path, the ``FileObject``)."""
        return f"{self.prefix}llm:file:{file_id}"

    def files_index_key(self, tenant: str) -> str:
        """Sorted set of a tenant's file ids, scored by creation time."""
        return f"{self.prefix}llm:files:{tenant}"

    def batch_key(self, batch_id: str) -> str:
        """Hash of one batch's state (its ``Batch`` object plus progress)."""
        return f"{self.prefix}llm:batch:{batch_id}"

    def batch_results_key(self, batch_id: str) -> str:
        """Hash of a batch's resolved lines: line number -> the line's outcome (JSON)."""
        return f"{self.prefix}llm:batch:{batch_id}:results"

    def batch_lock_key(self, batch_id: str) -> str:
        """Lock held by the one batch worker advancing this batch."""
        return f"{self.prefix}llm:batch:{batch_id}:lock"

    def batches_index_key(self, tenant: str) -> str:
        """Sorted set of a tenant's batch ids, scored by creation time."""
        return f"{self.prefix}llm:batches:{tenant}"

    @property
    def batches_active_key(self) -> str:
        """Sorted set of batches not yet in a final status, scored by creation time (the order they are served)."""
        return f"{self.prefix}llm:batches:active"

    @property
    def batch_collector_lock_key(self) -> str:
        """Lock held by the one collector reading ``llm.results``."""
        return f"{self.prefix}llm:batch-collector:lock"

    @property
    def batch_collector_offsets_key(self) -> str:
        """Hash of the collector's next ``llm.results`` offset per partition."""
        return f"{self.prefix}llm:batch-collector:offsets"

    @property
    def batch_rate_key(self) -> str:
        """Hash with the measured batch-line completion rate (lines/s) the ETAs divide by."""
        return f"{self.prefix}llm:batch-collector:rate"

    @property
    def batch_queue(self) -> str:
        """The Celery queue of the batch tasks."""
        return f"{self.prefix}sluicegate-batch"


#: Request ids of batch lines: ``<batch id>-L<line>``; the line number makes a republished chunk the same requests.
_BATCH_REQUEST = re.compile(r"^(batch_[A-Za-z0-9]+)-L([0-9]+)$")


def batch_request_id(batch_id: str, line: int) -> str:
    """The request id of ``batch_id``'s line ``line`` (1-based)."""
    return f"{batch_id}-L{line}"


def parse_batch_request_id(request_id: str) -> tuple[str, int] | None:
    """(batch id, line) of a batch line's request id; None for any other request."""
    match = _BATCH_REQUEST.match(request_id)
    return (match.group(1), int(match.group(2))) if match else None


# --- Kafka header names ---------------------------------------------------------------------------
#: Why a message went to the DLQ.
HEADER_REASON = "reason"
#: W3C trace context headers.
HEADER_TRACEPARENT = "traceparent"
HEADER_TRACESTATE = "tracestate"
#: The request id, so consumers can skip cancelled requests without parsing the body.
HEADER_REQUEST_ID = "request_id"
