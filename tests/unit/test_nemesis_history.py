"""Attributing stream entries from Redis's command log: MONITOR lines parsed as Redis quotes them, appends
replayed as Redis applies them (a replayed id refused), each accepted append given its sender's latest pick-up
epoch; entries that carry their writer and epoch use those instead."""

from __future__ import annotations

import json

import pytest

from benchmarks.nemesis_check import History, RequestHistory, check
from benchmarks.nemesis_history import CommandLog, entries_of, parse_monitor_line


def test_a_monitor_line_is_parsed_with_redis_quoting_undone() -> None:
    line = (
        '1796624823.809191 [0 10.9.0.10:44336] "xadd" "k" "0-1" "event" "{\\"a\\":\\"\\xc3\\xa9\\\\\\"x\\\\\\\\n\\"}"\n'
    )
    call = parse_monitor_line(line)
    assert call is not None and call.client == "10.9.0.10" and call.time == 1796624823.809191
    assert call.args[:3] == ("xadd", "k", "0-1")
    assert json.loads(call.args[4]) == {"a": 'é"x\\n'}
    lua = parse_monitor_line('1796624823.828500 [0 lua] "xadd" "k" "0-2" "event" "x"')
    assert lua is not None and lua.client == "lua"
    assert parse_monitor_line("OK") is None


def _event(seq: int, kind: str = "token") -> bytes:
    if kind == "done":
        body = {
            "type": "done",
            "request_id": "r1",
            "seq": seq,
            "finish_reason": "length",
            "usage": {"prompt_tokens": 1, "completion_tokens": seq, "total_tokens": seq + 1},
        }
    else:
        body = {"type": "token", "request_id": "r1", "seq": seq, "text": "a", "token_ids": [5]}
    return json.dumps(body).encode()


def _lines(script: list[tuple[str, str, int | None]]) -> list[str]:
    """(client ip, command, seq) -> MONITOR lines on stream ``p.llm:stream:r1``."""
    out = []
    for i, (ip, command, seq) in enumerate(script):
        args = (
            '"xrange" "p.llm:stream:r1" "-" "+"'
            if command == "xrange"
            else f'"xadd" "p.llm:stream:r1" "0-{seq + 1}" "event" "{{}}"'
        )
        out.append(f"{1000 + i}.000000 [0 {ip}:5000{i}] {args}")
    return out


def test_a_zombie_append_after_the_new_owners_pick_up_is_found_mixed() -> None:
    a, b = "10.9.0.10", "10.9.0.11"
    script = [
        (a, "xrange", None),
        *[(a, "xadd", s) for s in range(3)],
        (b, "xrange", None),  # b takes over: epoch 2
        (a, "xadd", 3),  # the zombie's append lands first
        (b, "xadd", 3),  # refused: id taken
        (b, "xadd", 4),
        (b, "xadd", 5),
    ]
    log = CommandLog({a: "w-a", b: "w-b"}, "p.llm:stream:")
    log.feed_file(["OK", '1.0 [0 10.9.0.99:1] "xadd" "other:key" "0-1"', *_lines(script)])
    assert log.refused_appends == 1
    raw = [(f"0-{s + 1}".encode(), {b"event": _event(s, "done" if s == 5 else "token")}) for s in range(6)]
    entries = entries_of("p.llm:stream:r1", raw, log)
    assert [(e.writer, e.epoch) for e in entries] == [("w-a", 1)] * 4 + [("w-b", 2)] * 2
    verdict = check(
        History(attribution="monitor", requests=[RequestHistory(request_id="r1", client="native", entries=entries)])
    )
    assert verdict.mixed == 1
    assert "seq 4 by w-b (epoch 2) continues a stream that seq 3 by w-a (epoch 1)" in verdict.account()


def test_a_clean_take_over_is_not_mixed_and_own_fields_win_over_the_log() -> None:
    a, b = "10.9.0.10", "10.9.0.11"
    script = [(a, "xrange", None), (a, "xadd", 0), (a, "xadd", 1), (b, "xrange", None), (b, "xadd", 2)]
    log = CommandLog({a: "w-a", b: "w-b"}, "p.llm:stream:")
    log.feed_file(_lines(script))
    raw = [(f"0-{s + 1}".encode(), {b"event": _event(s, "done" if s == 2 else "token")}) for s in range(3)]
    entries = entries_of("p.llm:stream:r1", raw, log)
    assert [(e.writer, e.epoch, e.newest_epoch) for e in entries] == [("w-a", 1, 1), ("w-a", 1, 1), ("w-b", 2, 2)]
    assert check(History(requests=[RequestHistory(request_id="r1", client="native", entries=entries)])).ok
    fenced = [(i, {**f, b"w": b"w-z", b"epoch": b"7"}) for i, f in raw]
    assert {(e.writer, e.epoch, e.newest_epoch) for e in entries_of("p.llm:stream:r1", fenced, log)} == {
        ("w-z", 7, None)
    }


def test_the_longest_pause_is_taken_only_from_streams_of_workers_the_fault_spared() -> None:
    a, b = "10.9.0.10", "10.9.0.11"
    lines = []
    for key, ip, times in (("p.llm:stream:ra", a, [1.0, 1.1, 3.5, 3.6]), ("p.llm:stream:rb", b, [1.0, 1.2, 1.3, 2.0])):
        lines.append(f'0.5 [0 {ip}:1] "xrange" "{key}" "-" "+"')
        lines += [f'{t} [0 {ip}:1] "xadd" "{key}" "0-{n + 1}" "event" "x"' for n, t in enumerate(times)]
    log = CommandLog({a: "w-a", b: "w-b"}, "p.llm:stream:")
    log.feed_file(sorted(lines, key=lambda line: float(line.split()[0])))
    writers = {"p.llm:stream:ra": {"w-a"}, "p.llm:stream:rb": {"w-b"}}
    assert log.longest_pauses([(1.05, 1.5, "w-b")], writers) == pytest.approx([2.4])  # ra, spared, paused 2.4 s
    assert log.longest_pauses([(1.15, 1.5, "w-a")], writers) == pytest.approx([0.7])  # rb's 1.3 -> 2.0
