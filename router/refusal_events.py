"""A Kafka-native record the router refuses still answers whoever reads its stream.

A producer learns of a refused record from ``llm.dlq``, but a client that only follows the request's Redis
stream (as docs/api.md tells Kafka-native producers to) would wait there forever: the router, unlike a worker,
writes nothing to it. So when the refused record's request id can be read, the router also appends one
``error`` event to ``llm:stream:<id>`` (the dead letter's reason as its code, the detail as its message), kept
``stream_ttl_s`` as a finished stream is; with tenants apart, to ``llm:stream:<tenant>:<id>``, the tenant being
its inbound topic's.

Only into a stream that does not exist yet: a record refused under the id of a request that already runs or
ran (a duplicate id, which docs/api.md asks producers not to send) must not end that request's stream. The
check and the append are one Lua script, so a worker cannot start the stream between them.

Only once the batch's dead letters are acknowledged and its offsets committed (one pipelined round trip for all
of the batch's refusals): an event written earlier could outlive a batch that failed and was re-read, in which
the record may be routed after all. A record routed on one read of its batch and refused on a later one (its
model's workers gone meanwhile) has both a routed copy and a dead letter; its event makes the refusal the answer
(a worker that meets the copy finds the request ended), as the dead letter already says. Best effort: the dead
letter is the durable record, and a Redis that does not answer costs only this courtesy (logged).
"""

from __future__ import annotations

import logging

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from schemas import STREAM_FIELD, ErrorEvent, Names, stream_entry_id
from sluicegate.record_check import Rejection, reason_kind

log = logging.getLogger(__name__)

# KEYS[1]: the stream. ARGV: the entry id, the field, the event's JSON, the TTL in seconds. 1 when appended.
_APPEND_IF_NEW = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('XADD', KEYS[1], ARGV[1], ARGV[2], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""

_MESSAGE_LIMIT = 2000


def refusal_event(rejection: Rejection) -> ErrorEvent | None:
    """The ``error`` event that tells a stream reader why its record was refused; None without a usable id."""
    if rejection.request_id is None:
        return None
    code = reason_kind(rejection.reason)  # the field of a schema violation is said in the message
    message = f"Refused by the router ({rejection.reason}): {rejection.detail}"
    try:
        return ErrorEvent(request_id=rejection.request_id, seq=0, code=code, message=message[:_MESSAGE_LIMIT])
    except ValidationError:  # an id that is no request id (the header of an unreadable record): no stream to tell
        return None


class RefusalEvents:
    """Appends a refused record's ``error`` event to its request's stream, when that stream is new."""

    def __init__(self, redis: Redis, names: Names, *, ttl_s: int) -> None:
        self._redis = redis
        self._names = names
        self._ttl_s = ttl_s
        self._script = redis.register_script(_APPEND_IF_NEW)

    async def tell(self, rejections: list[Rejection]) -> int:
        """Append each refusal's event, all in one round trip; how many were appended (not: no id, a stream
        already there, or no Redis)."""
        events = [(event, r.tenant) for r in rejections if (event := refusal_event(r)) is not None]
        if not events:
            return 0
        pipe = self._redis.pipeline(transaction=False)
        for event, tenant in events:
            key = self._names.stream_key(event.request_id, tenant)
            args = [stream_entry_id(event.seq), STREAM_FIELD, event.model_dump_json(), self._ttl_s]
            await self._script(keys=[key], args=args, client=pipe)
        try:
            return sum(map(bool, await pipe.execute()))
        except (RedisError, OSError) as exc:
            log.warning("router.refusal_events_failed requests=%d error=%r", len(events), exc)
            return 0
