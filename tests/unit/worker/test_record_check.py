"""How the worker reads a request record (:mod:`sluicegate.record_check`, shared with the router): the same
reasons, a deadline left to pick-up time, and the request id taken from the header first."""

from __future__ import annotations

import json
from datetime import timedelta

from aiokafka.structs import ConsumerRecord

from schemas import DeadLetter, InferenceRequest, utcnow
from schemas.names import HEADER_REQUEST_ID
from sluicegate.record_check import DETAIL_LIMIT, Rejection, dead_letter, request_id_of, validate_record

VALID = {"request_id": "r-1", "model": "llama", "prompt": "hello"}
HEADERS = [(HEADER_REQUEST_ID, b"from-header")]


def record(value: bytes | None, headers: list[tuple[str, bytes]]) -> ConsumerRecord:
    return ConsumerRecord(
        topic="llm.llama.standard",
        partition=0,
        offset=7,
        timestamp=0,
        timestamp_type=0,
        key=None,
        value=value,
        checksum=None,
        serialized_key_size=0,
        serialized_value_size=len(value or b""),
        headers=headers,
    )


def test_the_worker_leaves_an_expired_deadline_to_pick_up() -> None:
    past = json.dumps(VALID | {"deadline": (utcnow() - timedelta(seconds=1)).isoformat()}).encode()
    assert isinstance(validate_record(past, check_deadline=False), InferenceRequest)
    assert validate_record(past).reason == "deadline_exceeded"  # type: ignore[union-attr]


def test_the_request_id_comes_from_the_body_then_the_header() -> None:
    """The body's id names the request everywhere else (``dlq replay --request-id`` found nothing for a letter
    named by a different header); the header names a record whose body cannot be read."""
    for value in (b"", b"{not json", b"[1]"):
        rejection = validate_record(value, HEADERS)
        assert isinstance(rejection, Rejection) and rejection.request_id == "from-header"
    bad = json.dumps(VALID | {"prompt": 42}).encode()
    assert validate_record(bad, HEADERS).request_id == "r-1"  # type: ignore[union-attr]
    assert validate_record(bad).request_id == "r-1"  # type: ignore[union-attr]
    assert request_id_of(bad) == "r-1" and request_id_of(b"{", HEADERS) == "from-header"
    assert request_id_of(b"{") is None


def test_a_dead_letter_caps_its_detail_and_names_the_request() -> None:
    value, headers = dead_letter(Rejection("processing_failed", "x" * 10_000, "r-1"), record(b"{}", HEADERS))
    letter = DeadLetter.model_validate_json(value)
    assert len(letter.detail) == DETAIL_LIMIT and letter.request_id == "r-1" and letter.source_offset == 7
    assert dict(headers) == {"reason": b"processing_failed", HEADER_REQUEST_ID: b"r-1"}
