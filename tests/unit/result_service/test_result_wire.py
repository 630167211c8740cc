"""Turning stream entries into client events, and parsing resume points."""

from __future__ import annotations

import json
import logging

import pytest

from result_service.wire import BadLastId, parse_last_id, to_relayed
from schemas import DoneEvent, ErrorEvent, RestartEvent, TokenEvent, Usage
from sluicegate.stream_subscription import START_SEQ


@pytest.mark.parametrize(
    ("value", "seq"), [(None, START_SEQ), ("", START_SEQ), ("0-0", START_SEQ), ("0-1", 0), ("0-42", 41)]
)
def test_parse_last_id(value: str | None, seq: int) -> None:
    assert parse_last_id(value) == seq


@pytest.mark.parametrize("value", ["1700000000000-0", "0-", "abc", "0-x", "-1", "0--3"])
def test_parse_last_id_rejects_foreign_ids_with_a_hint(value: str) -> None:
    with pytest.raises(BadLastId, match="pass the 'id' of the last event"):
        parse_last_id(value)


def test_token_entry_becomes_the_client_event() -> None:
    event = TokenEvent(request_id="r1", seq=4, text="héllo", token_ids=[7, 8])
    item = to_relayed("k", b"0-5", {b"event": event.model_dump_json().encode()})
    assert item is not None
    assert (item.seq, item.entry_id, item.terminal) == (4, "0-5", False)
    assert json.loads(item.payload) == {
        "type": "token",
        "seq": 4,
        "request_id": "r1",
        "text": "héllo",
        "token_ids": [7, 8],
        "id": "0-5",
    }
    assert list(json.loads(item.payload))[:2] == ["type", "seq"]
    assert "héllo" in item.payload  # not \\u-escaped: smaller frames


def test_raw_resp_field_lists_are_understood() -> None:
    event = RestartEvent(request_id="r1", seq=0, discard_after_seq=-1)
    item = to_relayed("k", "0-1", [b"event", event.model_dump_json().encode()])
    assert item is not None
    assert json.loads(item.payload)["discard_after_seq"] == -1


@pytest.mark.parametrize(
    "event",
    [
        DoneEvent(
            request_id="r",
            seq=2,
            finish_reason="length",
            usage=Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3),
        ),
        ErrorEvent(request_id="r", seq=2, code="internal_error", message="boom"),
    ],
)
def test_done_and_error_are_terminal(event: DoneEvent | ErrorEvent) -> None:
    item = to_relayed("k", "0-3", {"event": event.model_dump_json()})
    assert item is not None and item.terminal


@pytest.mark.parametrize(
    ("entry_id", "fields", "log_text"),
    [
        ("0-1", {b"event": b"{not json"}, "invalid_event"),
        ("0-1", {b"other": b"{}"}, "entry_without_event"),
        (
            "0-9",
            {b"event": TokenEvent(request_id="r", seq=0, text="", token_ids=[]).model_dump_json().encode()},
            "seq_mismatch",
        ),
        ("1700-0", {b"event": b"{}"}, "bad_entry_id"),
    ],
)
def test_entries_that_break_the_contract_are_skipped_and_logged(
    entry_id: str, fields: dict[bytes, bytes], log_text: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert to_relayed("k", entry_id, fields) is None
    assert log_text in caplog.text
