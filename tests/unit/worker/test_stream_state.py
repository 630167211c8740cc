"""Folding a stream's entries into what clients received, per choice for ``n`` > 1 (what a resume continues)."""

from __future__ import annotations

from gpu_workers.worker.stream_state import stream_state_from_entries
from schemas import STREAM_FIELD, RestartEvent, StreamEvent, TokenEvent


def _entries(*events: StreamEvent) -> list[tuple[bytes, dict[bytes, bytes]]]:
    return [(f"0-{e.seq}".encode(), {STREAM_FIELD.encode(): e.model_dump_json().encode()}) for e in events]


def test_each_choice_keeps_its_own_tokens_text_and_end() -> None:
    state = stream_state_from_entries(
        _entries(
            TokenEvent(request_id="r", seq=0, text="a", token_ids=[1], index=0),
            TokenEvent(request_id="r", seq=1, text="b", token_ids=[2], index=1),
            TokenEvent(request_id="r", seq=2, text="c", token_ids=[3, 4], index=0),
            TokenEvent(request_id="r", seq=3, text="", token_ids=[], index=1, finish_reason="stop"),
            TokenEvent(request_id="r", seq=4, text="d", token_ids=[5], index=2),
        )
    )
    got = {i: (c.token_ids, c.text, c.finish_reason) for i, c in state.choices.items()}
    assert got == {0: ([1, 3, 4], "ac", None), 1: ([2], "b", "stop"), 2: ([5], "d", None)}
    assert state.next_seq == 5 and state.delivered == 5 and not state.finished


def test_a_restart_drops_what_came_after_it_in_every_choice() -> None:
    state = stream_state_from_entries(
        _entries(
            TokenEvent(request_id="r", seq=0, text="a", token_ids=[1], index=0),
            TokenEvent(request_id="r", seq=1, text="b", token_ids=[2], index=1),
            RestartEvent(request_id="r", seq=2, discard_after_seq=0),
            TokenEvent(request_id="r", seq=3, text="x", token_ids=[9], index=1),
        )
    )
    assert {i: c.text for i, c in state.choices.items()} == {0: "a", 1: "x"}
    assert state.token_ids == [1, 9] and state.next_seq == 4
