"""Schemathesis against the ingress's own OpenAPI document: generated requests (valid and invalid) to every
operation, against a real ingress on real Kafka and Redis with a fake worker answering, must never get a 5xx
and every response must match the document (status code, content type, headers, body schema).

Bounded: a fixed number of examples per operation, no Hypothesis database, one shared server.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ingress_support import KEY, MODEL, FakeWorker, delete_prefixed_keys, delete_prefixed_topics, running_ingress
from redis.asyncio import Redis
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.schemas import APIOperation

from ingress.app import create_app
from sluicegate.settings import Settings

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(300),
    # Raised from inside schemathesis's own strategies, not from anything this test controls.
    pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning"),
]

MAX_EXAMPLES = 40
AUTH = {"Authorization": f"Bearer {KEY}"}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


class ThreadedIngress:
    """A real ingress and a fake worker on an event loop of their own, for schemathesis's synchronous calls."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.url = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="ingress", daemon=True)

    def __enter__(self) -> ThreadedIngress:
        self._thread.start()
        assert self._ready.wait(60), "ingress did not start"
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        redis = Redis.from_url(self.settings.redis_url)
        try:
            async with FakeWorker(self.settings, redis), running_ingress(self.settings) as url:
                self.url = url
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._ready.set()
            await delete_prefixed_keys(redis, self.settings.topic_prefix)
            await redis.aclose()
            await delete_prefixed_topics(self.settings.kafka_bootstrap, self.settings.topic_prefix)


@pytest.fixture(scope="module")
def live_ingress(kafka_bootstrap: str, redis_url: str) -> Iterator[ThreadedIngress]:
    config = Settings(
        kafka_bootstrap=kafka_bootstrap,
        redis_url=redis_url,
        topic_prefix=f"s{uuid.uuid4().hex[:8]}.",
        topic_partitions=2,
        api_keys=KEY,
        stream_token_secret="schema-secret",
        served_models=MODEL,
        request_timeout_s=20.0,
    )
    with ThreadedIngress(config) as server:
        yield server


def _document() -> dict[str, Any]:
    # The document does not depend on the backbone; a throwaway app with placeholder settings serves it.
    return create_app(Settings(api_keys=KEY, stream_token_secret="schema-secret")).openapi()


schema = schemathesis.openapi.from_dict(_document())
# One test per operation, named by it. ``schema.parametrize()`` gave its 31 items one node id under pytest 9, and
# pytest-xdist, which schedules by node id, then ran one operation of the 31.
OPERATIONS = [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("operation", OPERATIONS, ids=[operation.label for operation in OPERATIONS])
def test_ingress_conforms_to_its_openapi_document(operation: APIOperation, live_ingress: ThreadedIngress) -> None:
    # Valid and invalid requests alike, as schemathesis's own fuzzing phase draws them.
    cases = st.one_of([operation.as_strategy(generation_mode=mode) for mode in GenerationMode])

    @given(case=cases)
    # print_blob: a failure drawn in one CI run prints the @reproduce_failure line that replays it anywhere.
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )
    def conforms(case: schemathesis.Case) -> None:
        body = case.body
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            # Most generated bodies name the served model, so they travel through Kafka to the fake worker and
            # back; the rest keep their random model and exercise the 404 path. Chosen by content, not by chance,
            # so Hypothesis can replay and shrink a failure.
            if zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode()) % 4:
                body["model"] = MODEL
        case.call_and_validate(base_url=live_ingress.url, headers=AUTH, checks=CHECKS, timeout=30)

    conforms()
