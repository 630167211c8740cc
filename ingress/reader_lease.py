"""This ingress instance's reader lease: a Redis key with a TTL (``Names.reader_key``), renewed every third of it
while the process lives and deleted when it stops.

Requests whose output this instance relays to an HTTP client that cannot resume it (the OpenAI-style endpoints)
name the lease in ``InferenceRequest.reader``. When their client leaves, ingress cancels them; when ingress itself
dies, nobody does, so workers watch the leases instead (``gpu_workers.worker.reader_leases``) and stop the requests of a
lease that lapsed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import uuid

from redis.asyncio import Redis
from redis.exceptions import RedisError

from schemas import Names
from sluicegate.task_stop import cancel_and_wait

log = logging.getLogger(__name__)

# A renewal that failed (Redis down or hung) is tried again this soon, well inside the lease.
_RETRY_S = 1.0


def instance_reader_id() -> str:
    """A reader id unique to this process: the host's name (as the id's pattern allows) and a random suffix."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64] or "ingress"
    return f"{host}-{uuid.uuid4().hex[:12]}"


class ReaderLease:
    """Holds the lease of one ingress instance; ``id`` is None when leases are off (``reader_lease_s`` 0)."""

    def __init__(self, redis: Redis, names: Names, lease_s: float) -> None:
        self._redis = redis
        self.id: str | None = instance_reader_id() if lease_s > 0 else None
        self._key = names.reader_key(self.id) if self.id is not None else ""
        self._ttl_ms = max(1, int(lease_s * 1000))
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Take the lease and keep renewing it in the background (on the running loop)."""
        if self.id is not None and self._task is None:
            self._task = asyncio.create_task(self._renew(), name="reader-lease")

    async def _renew(self) -> None:
        holder = f"{socket.gethostname()} pid {os.getpid()}"  # for an operator reading the key
        third_s = self._ttl_ms / 3000
        while True:
            try:
                # Bounded by a third of the lease: a hung Redis must not hold the renewal past the next one's time.
                await asyncio.wait_for(self._redis.set(self._key, holder, px=self._ttl_ms), timeout=max(0.5, third_s))
                delay = third_s
            except Exception as exc:  # any failure: the loop must go on, or a healthy ingress loses its lease
                # Workers stop this instance's requests only after the lease is seen missing for half of it: a
                # renewal retried within a second or two keeps a Redis blip from stopping them.
                log.warning("ingress.reader_lease_not_renewed", extra={"reader": self.id, "error": repr(exc)})
                delay = min(_RETRY_S, third_s)
            await asyncio.sleep(delay)

    async def close(self) -> None:
        """Stop renewing and give the lease up: requests still relayed here are stopped by their workers."""
        if self._task is None:
            return
        await cancel_and_wait(self._task)
        self._task = None
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self._redis.delete(self._key), 2.0)
