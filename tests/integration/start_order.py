"""The order a one-seat worker started requests in, read after the fact: with one engine seat each request starts
after the one before it finished, so their start order is their finish order, which each status record's
``result.finished_at`` gives. Polling the streams as they appear could see two appear (and finish) in one pass on a
loaded machine, and then had to guess their order."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from datetime import datetime

from redis.asyncio import Redis
from redis.exceptions import RedisError

from schemas import STREAM_FIELD, Names, RequestRecord, parse_stream_event


async def stream_done(redis: Redis, names: Names, request_id: str) -> bool:
    """Whether the request's stream ends with ``done``."""
    entries = await redis.xrange(names.stream_key(request_id))
    return bool(entries) and parse_stream_event(entries[-1][1][STREAM_FIELD.encode()]).type == "done"


async def finish_order(redis: Redis, names: Names, request_ids: Sequence[str], timeout_s: float) -> list[str]:
    """``request_ids`` in the order they finished, once every one has (its status record holds its result)."""
    finished: dict[str, datetime] = {}
    until = time.monotonic() + timeout_s
    while len(finished) < len(request_ids):
        assert time.monotonic() < until, f"not finished: {[r for r in request_ids if r not in finished]}"
        for rid in request_ids:
            if rid in finished:
                continue
            with contextlib.suppress(RedisError):
                raw = await redis.get(names.request_key(rid))
                if raw is not None and (record := RequestRecord.model_validate_json(raw)).result is not None:
                    finished[rid] = record.result.finished_at
        await asyncio.sleep(0.05)
    return sorted(request_ids, key=finished.__getitem__)
