"""What the router stream processor does with each inbound record: route it, or dead-letter it with a
reason that names the problem."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from aiokafka.structs import ConsumerRecord

from router.publish import request_headers
from router.refusal_events import refusal_event
from schemas import DeadLetter, InferenceRequest, TraceContext, utcnow
from sluicegate import record_check
from sluicegate.dead_letter_admin import DlqEntry, ReplayOutcome, check_payload, format_entry, replay_payload
from sluicegate.record_check import Rejection, dead_letter, request_id_of, validate_record

VALID = {"request_id": "r-1", "model": "llama", "prompt": "hello"}


def test_valid_record_becomes_a_request() -> None:
    request = validate_record(json.dumps(VALID).encode())
    assert isinstance(request, InferenceRequest)
    assert request.request_id == "r-1"


def test_unparseable_and_empty_records_are_rejected() -> None:
    assert validate_record(b"{not json").reason == "invalid_json"  # type: ignore[union-attr]
    # Nested past Python's recursion limit: a RecursionError once, which crashed the router on every start.
    deep = validate_record(b'{"request_id": "x", "prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}")
    assert isinstance(deep, Rejection) and deep.reason == "invalid_json" and "nested too deeply" in deep.detail
    not_finite = validate_record(json.dumps(VALID | {"sampling": {"temperature": float("nan")}}).encode())
    assert isinstance(not_finite, Rejection) and not_finite.reason == "invalid_json" and "NaN" in not_finite.detail
    assert request_id_of(b"[" * 3000 + b"]" * 3000) is None
    # A Java producer's String.getBytes(UTF_16): JSON, but not UTF-8, so not a record's JSON (not a field's fault).
    utf16 = validate_record(json.dumps(VALID).encode("utf-16"))
    assert isinstance(utf16, Rejection) and utf16.reason == "invalid_json" and "not UTF-8" in utf16.detail
    assert utf16.request_id == "r-1"  # still named by its body: its stream hears why
    # A UTF-8 byte-order mark first is ignored, as RFC 8259 allows; so does the replay of its dead letter.
    with_bom = b"\xef\xbb\xbf" + json.dumps(VALID).encode()
    assert isinstance(validate_record(with_bom), InferenceRequest)
    record = ConsumerRecord("llm.inbound", 0, 7, 0, 0, None, with_bom, None, 0, len(with_bom), [])
    letter = DeadLetter.model_validate_json(dead_letter(Rejection("unknown_model", "no worker", "r-1"), record)[0])
    assert isinstance(check_payload(letter), InferenceRequest)
    assert validate_record(b"").reason == "empty_message"  # type: ignore[union-attr]
    assert validate_record(None).reason == "empty_message"  # type: ignore[union-attr]


def test_a_record_that_fails_to_be_read_is_rejected_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever goes wrong reading a refused record, it is dead-lettered: raised, it would stop the consumer on
    that record at every start."""

    def broken(*_args: object) -> Rejection:
        raise RuntimeError("a reader bug")

    monkeypatch.setattr(record_check, "_classify", broken)
    got = validate_record(b'{"prompt": 42}', [("request_id", b"r-9")])
    assert isinstance(got, Rejection) and got.reason == "unreadable_record" and got.request_id == "r-9"
    assert "a reader bug" in got.detail


def test_schema_violations_name_the_field() -> None:
    bad_tier = validate_record(json.dumps(VALID | {"priority": "urgent"}).encode())
    assert isinstance(bad_tier, Rejection)
    assert bad_tier.reason == "schema_violation:priority"
    assert "'interactive', 'standard' or 'batch'" in bad_tier.detail
    assert bad_tier.request_id == "r-1"

    bad_temp = validate_record(json.dumps(VALID | {"sampling": {"temperature": 7}}).encode())
    assert isinstance(bad_temp, Rejection) and bad_temp.reason == "schema_violation:sampling.temperature"

    no_input = validate_record(json.dumps({"request_id": "r", "model": "m"}).encode())
    assert isinstance(no_input, Rejection) and no_input.reason == "schema_violation:prompt"

    # A regular expression that does not parse is the producer's mistake, caught here rather than by the worker.
    bad_regex = validate_record(json.dumps(VALID | {"guided": {"regex": "(["}}).encode())
    assert isinstance(bad_regex, Rejection) and bad_regex.reason == "schema_violation:guided.regex"
    assert "not a valid regular expression" in bad_regex.detail

    not_object = validate_record(b"[1, 2]")
    assert isinstance(not_object, Rejection) and not_object.reason == "not_an_object"
    assert not_object.request_id is None


def test_expired_deadline_is_rejected() -> None:
    past = (utcnow() - timedelta(seconds=1)).isoformat()
    rejection = validate_record(json.dumps(VALID | {"deadline": past}).encode())
    assert isinstance(rejection, Rejection) and rejection.reason == "deadline_exceeded"
    future = (utcnow() + timedelta(hours=1)).isoformat()
    assert isinstance(validate_record(json.dumps(VALID | {"deadline": future}).encode()), InferenceRequest)


def test_dead_letter_keeps_payload_position_and_trace() -> None:
    record = ConsumerRecord(
        topic="llm.inbound",
        partition=2,
        offset=41,
        timestamp=0,
        timestamp_type=0,
        key=b"k",
        value=b"\xff{broken",
        checksum=None,
        serialized_key_size=1,
        serialized_value_size=9,
        headers=[("traceparent", b"00-" + b"a" * 32 + b"-" + b"b" * 16 + b"-01")],
    )
    value, headers = dead_letter(Rejection("invalid_json", "bad"), record)
    letter = DeadLetter.model_validate_json(value)
    assert (letter.source_topic, letter.source_partition, letter.source_offset) == ("llm.inbound", 2, 41)
    assert letter.payload.endswith("{broken")
    assert dict(headers)["reason"] == b"invalid_json"
    assert "traceparent" in dict(headers)


@pytest.mark.parametrize("body", [b'"' * 2_200_000, b"\x01" * 400_000, b"a" * 3_000_000])
def test_a_dead_letter_always_fits_in_one_record(body: bytes) -> None:
    """JSON-escaping makes a letter up to six times its record (a quote takes 2 bytes, a control character 6):
    a record the broker took whole must still give a letter Kafka takes, cut and marked so, never replayed."""
    record = ConsumerRecord("llm.inbound", 0, 7, 0, 0, b"k", body, None, 1, len(body), [])
    value, _ = dead_letter(Rejection("invalid_json", "bad", "r-big"), record)
    letter = DeadLetter.model_validate_json(value)
    assert len(value) <= record_check.LETTER_LIMIT and letter.payload_truncated
    assert body.decode().startswith(letter.payload) and len(letter.payload) > record_check.LETTER_LIMIT // 10
    assert check_payload(letter) == "its payload was cut to fit the letter: the original record is not kept whole"
    one = ConsumerRecord("llm.inbound", 0, 8, 0, 0, b"k", b"x", None, 1, 1, [])
    small = DeadLetter.model_validate_json(dead_letter(Rejection("invalid_json", "bad"), one)[0])
    assert small.payload == "x" and not small.payload_truncated


def test_request_headers_prefer_the_carrier_then_the_request_trace() -> None:
    trace = TraceContext(traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    request = InferenceRequest(request_id="r", model="m", prompt="p", trace=trace)
    assert dict(request_headers(request)) == {"request_id": b"r", "traceparent": trace.traceparent.encode()}
    carrier = {"traceparent": "00-" + "3" * 32 + "-" + "4" * 16 + "-01", "tracestate": "v=1"}
    headers = dict(request_headers(request, carrier))
    assert headers["traceparent"] == carrier["traceparent"].encode() and headers["tracestate"] == b"v=1"


def test_a_refusal_tells_the_stream_its_reason_as_a_bare_code_when_its_id_is_a_request_id() -> None:
    event = refusal_event(Rejection("schema_violation:sampling.max_tokens", "'sampling.max_tokens': not an int", "r-1"))
    assert event is not None and (event.request_id, event.seq, event.code) == ("r-1", 0, "schema_violation")
    assert "schema_violation:sampling.max_tokens" in event.message and "not an int" in event.message
    assert refusal_event(Rejection("invalid_json", "not valid JSON", None)) is None
    # The header of an unreadable record may hold anything: no stream is named after it.
    assert refusal_event(Rejection("invalid_json", "not valid JSON", "no spaces allowed here")) is None
    long = refusal_event(Rejection("unknown_model", "x" * 10_000, "r-2"))
    assert long is not None and len(long.message) <= 2000


def test_a_reason_s_kind_leaves_out_the_field_a_producer_named() -> None:
    # Metric labels take the kind: a field name comes from the record's writer, and would grow a series per name.
    assert record_check.reason_kind("schema_violation:x_any_field_7f3a") == "schema_violation"
    assert record_check.reason_kind("deadline_exceeded") == "deadline_exceeded"


def _letter(body: dict[str, object]) -> tuple[DeadLetter, bytes]:
    raw = json.dumps(body).encode()
    record = ConsumerRecord("llm.inbound", 0, 7, 0, 0, None, raw, None, 0, len(raw), [])
    return DeadLetter.model_validate_json(dead_letter(Rejection("unknown_model", "no worker", "r-1"), record)[0]), raw


def test_a_replay_names_no_reader_and_keeps_other_records_byte_for_byte() -> None:
    """A replay is read from its status record and llm.results, not by the ingress that relayed the first try
    (long gone, its lease lapsed: workers would stop the replay), so it is sent without that ingress's reader."""
    plain, raw = _letter(VALID)
    checked = check_payload(plain)
    assert isinstance(checked, InferenceRequest) and replay_payload(plain, checked) == raw
    relayed, _ = _letter(VALID | {"reader": "ingress-1-abc"})
    checked = check_payload(relayed)
    assert isinstance(checked, InferenceRequest) and checked.reader == "ingress-1-abc"
    replayed = InferenceRequest.model_validate_json(replay_payload(relayed, checked))
    assert replayed.reader is None and replayed == checked.model_copy(update={"reader": None})


def test_a_letter_whose_only_fault_is_its_reader_replays_without_one() -> None:
    # As ingress and the router write them: with an ISO created_at, which only the contract's JSON mode reads.
    letter, _ = _letter(VALID | {"reader": "has space", "created_at": "2026-11-30T02:00:00+00:00"})
    checked = check_payload(letter)
    assert isinstance(checked, InferenceRequest) and checked.reader is None
    sent = json.loads(replay_payload(letter, checked))
    assert "reader" not in sent and sent["request_id"] == "r-1"
    still_bad, _ = _letter(VALID | {"reader": "has space", "prompt": 42})
    assert check_payload(still_bad) == "payload is still invalid (prompt.str: Input should be a valid string)"


def test_dlq_lines_show_a_producers_control_characters_escaped() -> None:
    """A refused request id with a newline (schema_violation:request_id) must not split ``sluicegate dlq``'s
    one line per entry."""
    letter, _ = _letter(VALID | {"request_id": "qa-nl\nforged  reason=fake"})
    letter = letter.model_copy(update={"request_id": "qa-nl\nforged  reason=fake"})
    # The reason names a producer's field too (schema_violation:<its key>).
    entry = DlqEntry(0, 3, utcnow(), "schema_violation:evil\nreason=forged", letter)
    for line in (format_entry(entry), ReplayOutcome(entry, "skipped", "x").line()):
        assert "\n" not in line and "request_id=qa-nl\\x0aforged" in line
    assert "reason=schema_violation:evil\\x0areason=forged" in format_entry(entry)
    bad_key, _ = _letter(VALID | {"evil\nkey": 1})
    why = check_payload(bad_key)
    assert isinstance(why, str) and "\n" not in why and "evil\\x0akey" in why
