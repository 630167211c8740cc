"""The dead-letter topic ``llm.dlq``, or a tenant's ``llm.dlq.<tenant>``: list what is on it, and replay the original
requests.

Both read the topic from the beginning with no consumer group (nothing is committed, so any number of
operators can look at once) up to the end offsets taken when the command starts.

Replay republishes a dead letter's original payload to ``llm.inbound``, not to its source topic: the
router then validates it again and routes it by the current load and tier, exactly as for any
Kafka-native producer, whether the router or a worker dead-lettered it. With tenants apart a letter goes back to its
tenant's inbound topic, and one read from a tenant's own DLQ (``--tenant``) only to that tenant's: the letters there
are the tenant's, as the router takes a record's tenant from the topic it came on. Entries whose payload is still
not a valid, unexpired request are skipped with the reason. A request whose stream already ended with
``done`` is skipped (it was served); one that ended with ``error`` has its stream cleared and its status
record set back to ``queued``, so the worker runs it afresh instead of skipping it as finished.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from aiokafka.structs import ConsumerRecord, TopicPartition
from pydantic import ValidationError
from redis.asyncio import Redis

from schemas import (
    BATCH_TERMINAL,
    STREAM_FIELD,
    DeadLetter,
    InferenceRequest,
    Names,
    RequestRecord,
    parse_batch_request_id,
    parse_stream_event,
    utcnow,
)
from schemas.names import HEADER_REASON, HEADER_REQUEST_ID, HEADER_TRACEPARENT, HEADER_TRACESTATE
from sluicegate.kafka import create_admin, create_consumer, create_producer, start_client
from sluicegate.record_check import record_json
from sluicegate.redis_client import create_redis
from sluicegate.settings import BackboneSettings, KafkaSettings


@dataclass
class DlqEntry:
    """One record of the DLQ topic; ``letter`` is None when the record is not a ``DeadLetter``."""

    partition: int
    offset: int
    timestamp: datetime
    reason: str
    letter: DeadLetter | None
    problem: str = ""

    @property
    def request_id(self) -> str | None:
        return self.letter.request_id if self.letter is not None else None


async def read_topic(
    bootstrap: str, topic: str, timeout_s: float = 30.0, *, settings: KafkaSettings | None = None
) -> list[ConsumerRecord]:
    """Every record of ``topic`` from the beginning to its end offsets as of now (empty if it does not exist),
    read with the security of ``settings`` (the environment's when None)."""
    admin = create_admin(settings, bootstrap=bootstrap)
    await start_client(admin, settings, bootstrap)
    try:
        described = await admin.describe_topics([topic])
    finally:
        await admin.close()
    info = described[0] if described else None
    if info is None or info["error_code"] != 0:
        return []
    parts = [TopicPartition(topic, p["partition"]) for p in info["partitions"]]
    consumer = create_consumer(group_id=None, settings=settings, bootstrap=bootstrap, client_id="sluicegate-dlq")
    await consumer.start()
    try:
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        end = await consumer.end_offsets(parts)
        records: list[ConsumerRecord] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # With read_committed, aborted transactional records never arrive but still use offsets, so the
        # position (not the count of records) says when the end is reached.
        while any([await consumer.position(tp) < end[tp] for tp in parts]):
            if loop.time() > deadline:
                raise TimeoutError(f"reading {topic} did not reach its end offsets within {timeout_s:.0f}s")
            batch = await consumer.getmany(*parts, timeout_ms=500)
            for tp_records in batch.values():
                records.extend(r for r in tp_records if r.offset < end[TopicPartition(r.topic, r.partition)])
        return records
    finally:
        await consumer.stop()


def _entry(record: ConsumerRecord) -> DlqEntry:
    header = next((v.decode(errors="replace") for k, v in record.headers or () if k == HEADER_REASON and v), None)
    stamp = datetime.fromtimestamp(record.timestamp / 1000, UTC)
    try:
        letter = DeadLetter.model_validate_json(record.value or b"")
    except ValidationError as exc:
        problem = f"not a DeadLetter record: {exc.errors(include_url=False)[0]['msg']}"
        return DlqEntry(record.partition, record.offset, stamp, header or "unknown", None, problem)
    return DlqEntry(record.partition, record.offset, stamp, header or letter.reason, letter)


def dlq_topic(settings: BackboneSettings, tenant: str | None = None) -> str:
    """The DLQ to read: ``tenant``'s own (tenants apart only), else the shared one; ``ValueError`` saying why a
    tenant cannot be read."""
    if tenant is None:
        return settings.names.dlq_topic
    if not settings.tenant_topics:
        raise ValueError(
            f"--tenant {tenant!r} needs tenants apart (SLUICEGATE_TENANT_TOPICS=true): with the shared topics every "
            f"tenant's dead letters are on {settings.names.dlq_topic}"
        )
    if settings.tenant_names and tenant not in settings.tenant_names:
        listed = ", ".join(settings.tenant_names)
        raise ValueError(f"--tenant {tenant!r} is not one of the tenants (SLUICEGATE_TENANTS: {listed})")
    return settings.names.dlq_topic_of(tenant)  # ValueError for a name no tenant may have


async def list_entries(
    settings: BackboneSettings, limit: int | None = None, *, tenant: str | None = None
) -> list[DlqEntry]:
    """Entries of the DLQ (``tenant``'s own when given), oldest first; with ``limit``, only the most recent."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    topic = dlq_topic(settings, tenant)
    entries = sorted(
        (_entry(r) for r in await read_topic(settings.kafka_bootstrap, topic, settings=settings)), key=_order
    )
    return entries[-limit:] if limit is not None else entries


def _order(entry: DlqEntry) -> tuple[datetime, int, int]:
    return (entry.timestamp, entry.partition, entry.offset)


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _printable(text: str | None) -> str:
    """A producer's string on one line: control characters (a newline in a refused request id) as escapes, so no
    entry can split or forge the one-line-per-entry output."""
    if not text:
        return "-"
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def format_entry(entry: DlqEntry) -> str:
    """One line per entry: when, why, where it came from, which request, and the detail."""
    when = entry.timestamp.isoformat(timespec="seconds").replace("+00:00", "Z")
    if entry.letter is None:
        return f"{when}  reason={_printable(entry.reason)}  dlq={entry.partition}@{entry.offset}  {entry.problem}"
    letter = entry.letter
    source = f"{letter.source_topic}[{letter.source_partition}]@{letter.source_offset}"
    detail = " ".join(letter.detail.split())
    if len(detail) > 160:
        detail = detail[:157] + "..."
    return (
        f"{when}  reason={_printable(entry.reason)}  source={source}  request_id={_printable(letter.request_id)}  "
        f"detail={json.dumps(detail, ensure_ascii=False)}"
    )


Action = Literal["replayed", "would replay", "skipped"]


@dataclass
class ReplayOutcome:
    entry: DlqEntry
    action: Action
    message: str

    def line(self) -> str:
        source = f"{self.entry.partition}@{self.entry.offset}"
        return f"{self.action:<12}  dlq={source}  request_id={_printable(self.entry.request_id)}  {self.message}"


def _matches(entry: DlqEntry, reason: str | None, request_id: str | None) -> bool:
    # A reason matches itself and its detailed forms: "schema_violation" matches "schema_violation:prompt".
    if reason is not None and entry.reason != reason and not entry.reason.startswith(reason + ":"):
        return False
    return request_id is None or entry.request_id == request_id


def check_payload(letter: DeadLetter) -> InferenceRequest | str:
    """The request to replay (without a reader: see :func:`replay_payload`), or why it still cannot be served."""
    if letter.payload_truncated:
        return "its payload was cut to fit the letter: the original record is not kept whole"
    raw = record_json(letter.payload.encode())
    try:
        request = InferenceRequest.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        fields = _json_object(raw)
        if fields is None or "reader" not in fields or any(e["loc"][:1] != ("reader",) for e in errors):
            error = errors[0]
            where = ".".join(str(p) for p in error["loc"]) or "message"
            return f"payload is still invalid ({_printable(where)}: {error['msg']})"
        # Only its reader is wrong, and a replay is sent without one anyway.
        try:
            # Through JSON again: the contract is strict, and only its JSON mode reads an ISO ``created_at``.
            without = json.dumps({k: v for k, v in fields.items() if k != "reader"})
            request = InferenceRequest.model_validate_json(without)
        except ValidationError:
            return "payload is still invalid (reader)"
    if request.expired():
        assert request.deadline is not None
        return f"its deadline {request.deadline.isoformat()} has passed"
    return request


def replay_payload(letter: DeadLetter, request: InferenceRequest) -> bytes:
    """What a replay publishes: the original record, byte for byte, unless it names a reader. That reader was the
    ingress relaying the first try to an HTTP client long gone; a replay is read from its status record and
    ``llm.results``, and a lapsed lease would have workers stop it, so it is sent without one."""
    fields = _json_object(record_json(letter.payload.encode()))
    if fields is None or "reader" not in fields:
        return letter.payload.encode()
    return request.model_copy(update={"reader": None}).model_dump_json(exclude={"reader"}).encode()


def _json_object(raw: bytes) -> dict[str, Any] | None:
    """A record's JSON object, or None when it is not one."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


async def _batch_ended(redis: Redis, names: Names, request_id: str) -> str | None:
    """Why a batch line is not replayed: its batch has ended, its output files written without it (a replayed line
    would run for nothing); None for a line of a running batch, or not a batch line."""
    parsed = parse_batch_request_id(request_id)
    if parsed is None:
        return None
    status = await redis.hget(names.batch_key(parsed[0]), "status")
    if status is None or status.decode() not in BATCH_TERMINAL:
        return None
    return f"its batch {parsed[0]} has ended ({status.decode()}): its output is written without this line"


async def _prepare_stream(redis: Redis, names: Names, request: InferenceRequest, dry_run: bool) -> str | None:
    """None when the request may run again (after clearing a failed stream); else why to skip it."""
    key = names.stream_key(request.request_id, request.tenant)
    last = await redis.xrevrange(key, "+", "-", count=1)
    if not last:
        return None
    event = parse_stream_event(last[0][1][STREAM_FIELD.encode()])
    if event.type == "done":
        return "already finished: its stream ends with done"
    if event.type == "error" and not dry_run:
        raw = await redis.get(names.request_key(request.request_id, request.tenant))
        pipe = redis.pipeline(transaction=True)
        pipe.delete(key)
        if raw is not None:
            record = RequestRecord.model_validate_json(raw)
            queued = record.model_copy(update={"status": "queued", "updated_at": utcnow(), "result": None})
            pipe.set(names.request_key(request.request_id, request.tenant), queued.model_dump_json(), keepttl=True)
        await pipe.execute()
    return None


async def replay(
    settings: BackboneSettings,
    *,
    reason: str | None = None,
    request_id: str | None = None,
    dry_run: bool = False,
    tenant: str | None = None,
) -> list[ReplayOutcome]:
    """Republish matching dead letters of the DLQ (``tenant``'s own when given) to the inbound topic (see the module
    docstring); one outcome each."""
    names = settings.names
    entries = [e for e in await list_entries(settings, tenant=tenant) if _matches(e, reason, request_id)]
    outcomes: list[ReplayOutcome] = []
    redis = create_redis(settings, client_name="sluicegate-dlq")
    producer = None if dry_run else create_producer(settings, client_id="sluicegate-dlq")
    if producer is not None:
        await producer.start()
    replayed: set[str] = set()
    try:
        # Newest first, so that of several letters for one request the latest is the one replayed.
        for entry in sorted(entries, key=_order, reverse=True):
            if entry.letter is None:
                outcomes.append(ReplayOutcome(entry, "skipped", entry.problem))
                continue
            checked = check_payload(entry.letter)
            if tenant is not None and isinstance(checked, InferenceRequest):
                checked = _as_tenant(checked, tenant)
            if isinstance(checked, str):
                outcomes.append(ReplayOutcome(entry, "skipped", checked))
                continue
            if checked.request_id in replayed:
                outcomes.append(ReplayOutcome(entry, "skipped", "a newer letter for this request is replayed"))
                continue
            why_not = await _batch_ended(redis, names, checked.request_id) or await _prepare_stream(
                redis, names, checked, dry_run
            )
            if why_not is not None:
                outcomes.append(ReplayOutcome(entry, "skipped", why_not))
                continue
            replayed.add(checked.request_id)
            # With tenants apart the router reads each tenant's own topic, and takes the tenant from it.
            inbound = names.tenant_inbound_topic(checked.tenant) if names.tenants_apart else names.inbound_topic
            if producer is None:
                outcomes.append(ReplayOutcome(entry, "would replay", f"to {inbound}"))
                continue
            await producer.send_and_wait(
                inbound,
                replay_payload(entry.letter, checked),
                key=checked.request_id.encode(),
                headers=_headers(checked),
            )
            outcomes.append(ReplayOutcome(entry, "replayed", f"to {inbound}"))
    finally:
        if producer is not None:
            await producer.stop()
        await redis.aclose()
    outcomes.sort(key=lambda o: _order(o.entry))
    return outcomes


def _as_tenant(request: InferenceRequest, tenant: str) -> InferenceRequest | str:
    """A letter of ``tenant``'s own DLQ as the router would take it on the tenant's topic: a record naming no tenant
    is the tenant's; one naming another is not replayed (the router would refuse it again)."""
    if "tenant" not in request.model_fields_set:
        return request.model_copy(update={"tenant": tenant})
    if request.tenant != tenant:
        return f"it names tenant {request.tenant!r} but is on tenant {tenant!r}'s DLQ: its topic would refuse it"
    return request


def _headers(request: InferenceRequest) -> list[tuple[str, bytes]]:
    headers = [(HEADER_REQUEST_ID, request.request_id.encode())]
    if request.trace is not None:
        headers.append((HEADER_TRACEPARENT, request.trace.traceparent.encode()))
        if request.trace.tracestate:
            headers.append((HEADER_TRACESTATE, request.trace.tracestate.encode()))
    return headers


def summary(outcomes: Sequence[ReplayOutcome]) -> str:
    counts = {action: sum(o.action == action for o in outcomes) for action in ("replayed", "would replay", "skipped")}
    return ", ".join(f"{n} {action}" for action, n in counts.items() if n) or "no matching entries"
