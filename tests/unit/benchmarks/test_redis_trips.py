"""benchmarks.redis_trips counts a monitor capture's commands and round trips per request, by process."""

from __future__ import annotations

from benchmarks.redis_trips import report, summarize

DONE = '"{\\"request_id\\":\\"r1\\",\\"seq\\":1,\\"type\\":\\"done\\"}"'
CAPTURE = f"""OK
100.000000 [0 127.0.0.1:1] "SET" "p.llm:request:r1" "{{}}" "NX" "EX" "86400"
100.001000 [0 127.0.0.1:2] "XRANGE" "p.llm:stream:r1" "-" "+"
100.001010 [0 127.0.0.1:2] "GET" "p.llm:request:r1"
100.001020 [0 127.0.0.1:2] "EXISTS" "p.llm:cancel:r1"
100.002000 [0 127.0.0.1:3] "XREVRANGE" "p.llm:stream:r1" "+" "-" "COUNT" "1"
100.002010 [0 127.0.0.1:3] "GET" "p.llm:request:r1"
100.003000 [0 127.0.0.1:2] "SET" "p.llm:request:r1" "{{}}" "EX" "3600"
100.003010 [0 127.0.0.1:2] "XADD" "p.llm:stream:r1" "0-1" "event" "{{}}"
100.004000 [0 127.0.0.1:2] "XADD" "p.llm:stream:r1" "0-2" "event" {DONE}
100.004020 [0 127.0.0.1:2] "EXPIRE" "p.llm:stream:r1" "3600"
100.005000 [0 127.0.0.1:3] "XREAD" "COUNT" "512" "BLOCK" "1000" "STREAMS" "p.llm:stream:r1" "0-0"
100.009000 [0 127.0.0.1:2] "SET" "p.llm:request:r1" "{{}}" "EX" "3600"
100.0090"""  # the capture's end cut the last line


def test_commands_are_grouped_into_round_trips_per_connection_and_process() -> None:
    traffic = summarize(CAPTURE.splitlines())
    assert traffic.requests == 1
    worker = traffic.by_process["worker"]
    assert worker.n_commands == 8 and worker.commands["XADD"] == 2 and worker.commands["SET"] == 2
    # pickup reads, running record + first token, last token's done + EXPIRE, final record alone
    assert worker.trips == {("EXISTS", "GET", "XRANGE"): 1, ("SET", "XADD"): 1, ("EXPIRE", "XADD"): 1, ("SET",): 1}
    relay = traffic.by_process["result-service"]
    assert relay.n_commands == 3 and relay.trips == {("GET", "XREVRANGE"): 1, ("XREAD",): 1}
    assert traffic.by_process["ingress/other"].trips == {("SET",): 1}
    text = report(traffic)
    assert "all processes: 12.00 commands, 7.00 round trips per request" in text
    assert "1.00 round trips: status records only" in text


def test_a_narrower_gap_splits_a_pipeline() -> None:
    worker = summarize(CAPTURE.splitlines(), gap_s=5e-6).by_process["worker"]
    assert worker.n_trips == 8  # every command its own round trip


def test_a_transaction_is_one_round_trip_however_slowly_monitor_prints_it() -> None:
    capture = """100.000000 [0 127.0.0.1:2] "MULTI"
100.000400 [0 127.0.0.1:2] "SET" "p.llm:request:r1" "{}" "EX" "3600"
100.000900 [0 127.0.0.1:2] "XADD" "p.llm:stream:r1" "0-1" "event" "{}"
100.001300 [0 127.0.0.1:2] "EXEC"
100.001350 [0 127.0.0.1:2] "XRANGE" "p.llm:stream:r2" "-" "+"
100.009000 [0 127.0.0.1:2] "SET" "p.llm:request:r1" "{}" "EX" "3600"
"""
    worker = summarize(capture.splitlines()).by_process["worker"]
    # MULTI..EXEC and the read right after it are one pipeline; the SET 8 ms later is a round trip of its own.
    assert worker.trips == {("EXEC", "MULTI", "SET", "XADD", "XRANGE"): 1, ("SET",): 1}
