"""Schemathesis against the ingress's own OpenAPI document: generated requests (valid and invalid) to every
operation, against a real ingress on real Kafka and Redis with a fake worker answering, must never get a 5xx
and every response must match the document (status code, content type, headers, body schema).

Both directions of the document's promise are checked too. A request the document allows must be accepted (a
2xx), but for the refusals ``LEGIT_REFUSALS`` names per operation, each by status, error code and param: those
that depend on the server's state (an unknown id or model, the clock) and those for a rule JSON Schema cannot
state, which the field's description says instead (a named tool must be one of ``tools``, a file must hold JSONL
requests). A request the document forbids must be refused (a 4xx).

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
from schemathesis import GenerationMode, Response
from schemathesis.checks import (
    CheckContext,
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.config import SchemathesisConfig
from schemathesis.core.failures import ServerError
from schemathesis.core.parameters import ParameterLocation
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.schemas import APIOperation

from ingress.app import create_app
from sluicegate.lora.checks import CheckVerdict, serve_checks
from sluicegate.settings import Settings
from sluicegate.task_stop import cancel_and_wait

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(300),
    # Raised from inside schemathesis's own strategies, not from anything this test controls.
    pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning"),
]

MAX_EXAMPLES = 100
ADMIN_KEY = "sk-schema-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# The LoRA operations need an admin key: with any other, every request would be the same 403.
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
ADMIN_OPERATIONS = frozenset({"POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter"})

# A refusal: status, error code, param.
Refusal = tuple[int, str | None, str | None]
UNKNOWN_MODEL: Refusal = (404, "model_not_found", "model")
# A deadline (an RFC 3339 time) that has passed: the clock's doing, not the request's shape.
PASSED_DEADLINE: Refusal = (400, "invalid_value", "deadline")
# A deadline that passed while the request was accepted (a microsecond from now): the server keeping to it.
DEADLINE_EXCEEDED: Refusal = (504, "deadline_exceeded", None)
SUBMIT = frozenset({UNKNOWN_MODEL, PASSED_DEADLINE, DEADLINE_EXCEEDED})
# A named tool_choice must be one of the tools given: a rule between values, not shapes.
UNKNOWN_TOOL: Refusal = (400, "invalid_value", "tool_choice")
FILE_CONTENT = frozenset(
    (400, code, "file")
    for code in (
        "invalid_json_line",
        "invalid_request_line",
        "duplicate_custom_id",
        "mixed_endpoints",
        "too_many_lines",
        "empty_file",
    )
)
NO_RESPONSE: Refusal = (404, "not_found", None)

#: Per operation, the refusals a request the document allows may get all the same (see the module docstring).
#: 401 and 429 are none of them: the test's keys are valid and unlimited, and the fake worker reports no backlog.
LEGIT_REFUSALS: dict[str, frozenset[Refusal]] = {
    "POST /v1/chat/completions": SUBMIT
    | {UNKNOWN_TOOL, (400, "invalid_value", "response_format.json_schema.schema")},  # not a valid JSON Schema
    "POST /v1/completions": SUBMIT | {(400, "invalid_value", "response_format.json_schema.schema")},
    "POST /v1/embeddings": SUBMIT,
    "POST /v1/requests": SUBMIT,
    "POST /v1/responses": SUBMIT
    | {
        UNKNOWN_TOOL,
        (400, "invalid_value", "text.format.schema"),
        (404, "not_found", "previous_response_id"),
        # A function_call_output must answer a function_call of the conversation.
        (400, "invalid_value", "input"),
    },
    "GET /v1/models/{model}": frozenset({UNKNOWN_MODEL}),
    "GET /v1/requests/{request_id}": frozenset({(404, "request_not_found", "request_id")}),
    "DELETE /v1/requests/{request_id}": frozenset({(404, "request_not_found", "request_id")}),
    "POST /v1/files": FILE_CONTENT,
    "GET /v1/files/{file_id}": frozenset({(404, "not_found", "file_id")}),
    "DELETE /v1/files/{file_id}": frozenset({(404, "not_found", "file_id")}),
    "GET /v1/files/{file_id}/content": frozenset({(404, "not_found", "file_id")}),
    "POST /v1/batches": frozenset({(404, "not_found", "input_file_id")}),
    "GET /v1/batches/{batch_id}": frozenset({(404, "not_found", "batch_id")}),
    "POST /v1/batches/{batch_id}/cancel": frozenset({(404, "not_found", "batch_id")}),
    "POST /tokenize": frozenset({UNKNOWN_MODEL}),
    # Token ids past the model's vocabulary: the vocabulary is the model's, not the document's.
    "POST /detokenize": frozenset({UNKNOWN_MODEL, (400, "token_out_of_vocabulary", "tokens")}),
    "GET /v1/responses/{response_id}": frozenset({NO_RESPONSE}),
    "DELETE /v1/responses/{response_id}": frozenset({NO_RESPONSE}),
    "POST /v1/responses/{response_id}/cancel": frozenset({NO_RESPONSE}),
    "GET /v1/responses/{response_id}/input_items": frozenset({NO_RESPONSE}),
    # start and end are each valid alone; together they must make a window of at most 400 days, end after start.
    "GET /v1/usage": frozenset({(400, "invalid_value", "start"), (400, "invalid_value", "end")}),
    "POST /v1/load_lora_adapter": frozenset(
        {(404, "model_not_found", "base_model"), (409, "adapter_exists", "lora_name")}
    ),
    "POST /v1/unload_lora_adapter": frozenset({(404, "adapter_not_found", "lora_name")}),
}


def _refusal(response: Response) -> Refusal:
    try:
        error = response.json()["error"]
        return response.status_code, error.get("code"), error.get("param")
    except (ValueError, KeyError, TypeError):
        return response.status_code, None, None


def no_server_error(ctx: CheckContext, response: Response, case: schemathesis.Case) -> bool | None:
    """schemathesis' ``not_a_server_error``, but for the 504 that ends a request whose own deadline passed."""
    try:
        return not_a_server_error(ctx, response, case)
    except ServerError:
        if _refusal(response) == DEADLINE_EXCEEDED and isinstance(case.body, dict) and "deadline" in case.body:
            return None
        raise


def accepts_valid_requests(ctx: CheckContext, response: Response, case: schemathesis.Case) -> bool | None:
    """schemathesis' ``positive_data_acceptance`` (a 2xx for a request the document allows, see ``CONFIG``), less
    the refusals ``LEGIT_REFUSALS`` allows the operation."""
    try:
        return positive_data_acceptance(ctx, response, case)
    except RejectedPositiveData:
        if _refusal(response) in LEGIT_REFUSALS.get(case.operation.label, frozenset()):
            return None
        raise


def rejects_invalid_bodies(ctx: CheckContext, response: Response, case: schemathesis.Case) -> bool | None:
    """schemathesis' ``negative_data_rejection`` (a 4xx for a request the document forbids, see ``CONFIG``) for a
    request whose body the document forbids. The bodies are where the document and the validation can drift apart
    (ingress parses most by hand, FastAPI cannot see them); parameters are FastAPI's, checked against the schema it
    documents, and one drawn invalid can be valid on the wire (a string query parameter drawn as an object is sent
    as repeated values, of which the server takes the last)."""
    body = case.meta.components.get(ParameterLocation.BODY) if case.meta is not None else None
    if body is None or not body.mode.is_negative:
        return None
    return negative_data_rejection(ctx, response, case)


CHECKS = [
    no_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    accepts_valid_requests,
    rejects_invalid_bodies,
]
# Only a 2xx accepts a valid request (schemathesis would also take any 401, 403, 404, 409 and 429); a request the
# document forbids must get a 4xx that says so (schemathesis's list, less the ones that are no refusal of the
# request's shape).
CONFIG = SchemathesisConfig.from_dict(
    {
        "checks": {
            "positive_data_acceptance": {"expected-statuses": ["2xx"]},
            "negative_data_rejection": {"expected-statuses": ["400", "401", "403", "404", "405", "413", "415"]},
        }
    }
)


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
        # A worker's adapter check, standing in for the engine's: the document cannot say which files are an
        # adapter, so every path is taken (the load path then runs to its end, registration included).
        checks = asyncio.create_task(serve_checks(redis, self.settings.topic_prefix, MODEL, _any_adapter))
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
            await cancel_and_wait(checks)
            await delete_prefixed_keys(redis, self.settings.topic_prefix)
            await redis.aclose()
            await delete_prefixed_topics(self.settings.kafka_bootstrap, self.settings.topic_prefix)


async def _any_adapter(name: str, path: str) -> CheckVerdict:
    return CheckVerdict(ok=True, rank=8)


@pytest.fixture(scope="module")
def live_ingress(kafka_bootstrap: str, redis_url: str) -> Iterator[ThreadedIngress]:
    config = Settings(
        kafka_bootstrap=kafka_bootstrap,
        redis_url=redis_url,
        topic_prefix=f"s{uuid.uuid4().hex[:8]}.",
        topic_partitions=2,
        api_keys=KEY,
        admin_api_keys=ADMIN_KEY,
        stream_token_secret="schema-secret",
        served_models=MODEL,
        request_timeout_s=20.0,
        # The bound counts the workers' consumer group's lag, and the fake worker reads without a group: every
        # request it answered would count as waiting, until the bound turned away every valid request (429).
        max_backlog_per_model=0,
    )
    with ThreadedIngress(config) as server:
        yield server


def _document() -> dict[str, Any]:
    # The document does not depend on the backbone; a throwaway app with placeholder settings serves it.
    return create_app(Settings(api_keys=KEY, stream_token_secret="schema-secret")).openapi()


schema = schemathesis.openapi.from_dict(_document(), config=CONFIG)
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
        positive = case.meta is not None and case.meta.generation.mode.is_positive
        if positive and isinstance(body, dict) and isinstance(body.get("model"), str):
            # Most valid bodies name the served model, so they travel through Kafka to the fake worker and
            # back; the rest keep their random model and exercise the 404 path. Chosen by content, not by chance,
            # so Hypothesis can replay and shrink a failure. (An invalid body keeps its model: that may be what
            # makes it invalid.)
            if zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode()) % 4:
                body["model"] = MODEL
        headers = ADMIN_AUTH if operation.label in ADMIN_OPERATIONS else AUTH
        case.call_and_validate(base_url=live_ingress.url, headers=headers, checks=CHECKS, timeout=30)

    conforms()
